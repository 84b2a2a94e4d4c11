"""Muon on expert weights under expert parallelism: each expert's matrix is orthogonalized whole,
on one rank of the ranks holding that expert (under ``tensor`` it lies there whole; under flat
placements its owner gathers it), so a (W 4, EP 2) run follows one process.

6 steps of ``tiny-moe`` with Muon (Newton–Schulz in fp32) for the matrices, experts included,
and the global load-balancing loss (so that the objective itself does not depend on the layout):
losses and gradient norms within 1e-6 relative of one process on the same global batch, under
``tensor`` and under ``even`` (measured: 1.7e-7 and 9.3e-8; the rest is the order of sums: the
experts' gradients come from tokens gathered from both EP ranks)."""

from __future__ import annotations

import pytest
import torch

from mfsdp_core import describe_shards, fully_shard
from mfsdp_core.expert_parallel import expert_placement, init_expert_mesh
from mfsdp_core.models.gpt import GPTModel, get_preset, shard_experts, shard_units
from tests.torchrun import failure, read_metrics, run_train

RUN = (
    "--model", "tiny-moe", "--optimizer", "muon", "--ns-dtype", "float32", "--moe-aux-loss", "global",
    "--steps", "6", "--batch-size", "8", "--seq-len", "16", "--seed", "3",
)  # fmt: skip
BOUND = 1e-6


def _worst(a: dict, b: dict, field: str) -> float:
    return max(abs(a[s][field] - b[s][field]) / abs(b[s][field]) for s in b)


@pytest.mark.heavy
def test_muon_with_ep2_follows_one_process(tmp_path):
    runs = {}
    for name, nproc, extra in (("one", 1, ()), ("tensor", 4, ("--policy", "tensor")), ("even", 4, ())):
        metrics = tmp_path / f"{name}.jsonl"
        ep = ("--ep", "2") if nproc > 1 else ()
        run = run_train(nproc, *RUN, *ep, *extra, "--metrics", str(metrics))
        assert run.returncode == 0, failure(run)
        runs[name] = read_metrics(metrics)
    for name in ("tensor", "even"):
        assert _worst(runs[name], runs["one"], "loss") <= BOUND, name
        assert _worst(runs[name], runs["one"], "grad_norm") <= BOUND, name


def _expert_pieces() -> dict:
    mesh = init_expert_mesh(2, 4)
    torch.manual_seed(0)
    model = shard_experts(GPTModel(get_preset("tiny-moe")), mesh)
    for unit in shard_units(model):
        fully_shard(unit, mesh=mesh.groups, placement=expert_placement("tensor"))
    return {
        ps.fqn: (ps.main.start, ps.main.end, ps.shape.numel())
        for ps in describe_shards(model)
        if ps.is_expert and ps.main.end > ps.main.start
    }


def test_under_tensor_each_expert_matrix_lies_whole_on_one_rank(ranks):
    out = ranks(_expert_pieces, 4, timeout=120)
    holders: dict[str, list[int]] = {}
    for rank, pieces in enumerate(out):
        for fqn, (start, end, numel) in pieces.items():
            assert (start, end) == (0, numel), (rank, fqn)  # whole, never a piece
            holders.setdefault(fqn, []).append(rank)
    # 2 layers x 4 experts x fc1/fc2, each held whole by exactly one rank of its expert-data-parallel pair
    assert len(holders) == 2 * 4 * 2 and all(len(r) == 1 for r in holders.values())
    for fqn, (rank,) in holders.items():
        expert = int(fqn.rsplit("weight", 1)[1])
        assert rank % 2 == expert // 2  # EP rank r holds experts 2r, 2r+1; its EDP pair is ranks r, r+2
