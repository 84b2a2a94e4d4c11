"""``mfsdp-ckpt reshard``: a checkpoint saved at 4 ranks rewritten for 1, 3 and 8 ranks verifies,
diffs equal to its source, puts each target rank's data in that rank's file, and a training run
resumed from it continues bitwise as it would have from the source. Bad input leaves nothing at
DST."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

import mfsdp_ckpt
from cli.main import main
from mfsdp_ckpt.read.reader import CheckpointReader
from mfsdp_ckpt.sharded.reshard import reshard
from mfsdp_ckpt.tools.diff import diff_checkpoints
from mfsdp_ckpt.tools.inspect import verify_checkpoint
from mfsdp_ckpt.write.builder import CheckpointBuilder
from mfsdp_core import ModelPlan, compute_layout, plan_model
from mfsdp_core.models.gpt import GPTConfig, GPTModel, shard_units
from tests.mfsdp_ckpt.util import build, owned_pieces, train_steps
from tests.torchrun import ENV, ROOT, failure, run_train

TRAIN = ("--model", "tiny-moe", "--batch-size", "24", "--seq-len", "16", "--seed", "3", "--warmup", "2", "--steps", "5")


def _train(nproc: int, *args: str) -> subprocess.CompletedProcess:
    return run_train(nproc, *TRAIN, *args)


def _cli_subprocess(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cli.main", *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300
    )


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> str:
    """A tiny-moe checkpoint written by the trainer at 4 ranks, ZeRO-3, row policy, step 2."""
    run = tmp_path_factory.mktemp("reshard") / "src_run"
    out = _train(4, "--policy", "row", "--stop-at", "2", "--ckpt-dir", str(run))
    assert out.returncode == 0, failure(out)
    return str(run / "step_000002")


def _resume_metrics(ckpt: str, run_dir, nproc: int, by_path: bool) -> tuple[list[dict], str]:
    """Resume from ``ckpt`` at ``nproc`` ranks for the remaining steps (``--resume CKPT``, or a
    copy of it as ``<ckpt-dir>/latest``); per-step metrics and the final checkpoint."""
    os.makedirs(run_dir)
    if by_path:
        resume = ["--resume", ckpt]
    else:
        shutil.copytree(ckpt, os.path.join(run_dir, "step_000002"))
        with open(os.path.join(run_dir, "latest"), "w") as f:
            f.write("step_000002\n")
        resume = ["--resume"]
    metrics = os.path.join(run_dir, "m.jsonl")
    out = _train(nproc, "--policy", "row", "--ckpt-dir", str(run_dir), *resume, "--metrics", metrics)
    assert out.returncode == 0, failure(out)
    with open(metrics) as f:
        return [json.loads(line) for line in f], os.path.join(run_dir, "step_000005")


def _owner_files(ckpt: str) -> dict[str, set[tuple[str, int]]]:
    """For every parameter-shaped key: the (file, target shard rank) pairs of its chunks."""
    with CheckpointReader(ckpt) as reader:
        plan = reader.manifest["writer"]["plan"]
        out: dict[str, set] = {}
        for g in plan["buffers"]:
            assert g["group"] == "dp" and g["strategy"] != "no_shard"
            shapes = [reader.shape(f"model.{n}") for n in g["params"]]
            assert shapes == [torch.Size(s) for s in g["shapes"]]
            layout = compute_layout(shapes, g["group_size"], g["policy"], g["params"])
            for i, name in enumerate(g["params"]):
                for key in [k for k in reader.keys() if k == f"model.{name}" or k.startswith(f"optim.{name}.")]:
                    md = reader.metadata.state_dict_metadata[key]
                    if tuple(md.size) != tuple(shapes[i]):
                        continue  # e.g. Adam's scalar step
                    for index, info in reader.metadata.storage_data.items():
                        if index.fqn != key:
                            continue
                        start = sum(
                            o * md.size[k + 1 :].numel() for k, o in enumerate(index.offset)
                        )  # chunk's first element
                        r = next(
                            r
                            for r in range(g["group_size"])
                            if layout.piece(i, r).start <= start < layout.piece(i, r).end
                        )
                        out.setdefault(key, set()).add((info.relative_path, r))
        return out


@pytest.mark.heavy
@pytest.mark.parametrize("world", [1, 3, 8])
def test_reshard_4_to_n_verifies_diffs_equal_and_resumes_bitwise(source, tmp_path, world):
    dst = str(tmp_path / f"w{world}")
    if world == 3:  # one through a real subprocess, the others through click's runner
        out = _cli_subprocess("reshard", source, dst, "--world-size", "3", "--workers", "2")
        assert out.returncode == 0, out.stderr
        assert "for world size 3" in out.stdout
    else:
        res = CliRunner().invoke(main, ["reshard", source, dst, "--world-size", str(world), "--json"])
        assert res.exit_code == 0, res.output
        assert json.loads(res.output)["files"] == world
    assert verify_checkpoint(dst) == []
    assert diff_checkpoints(source, dst).equal
    assert CliRunner().invoke(main, ["diff", source, dst]).exit_code == 0

    # every chunk of rank r's range sits in rank r's file
    owners = _owner_files(dst)
    with CheckpointReader(dst) as reader:
        assert {k for k in owners if k.startswith("model.")} == {k for k in reader.keys() if k.startswith("model.")}
    assert {r for pairs in owners.values() for _, r in pairs} == set(range(world))  # every rank's file is used
    for key, pairs in owners.items():
        for file, r in pairs:
            assert file == f"__{r}_0.distcp", (key, file, r)

    from_source, final_source = _resume_metrics(source, tmp_path / "from_source", world, by_path=False)
    from_resharded, final_resharded = _resume_metrics(dst, tmp_path / "from_resharded", world, by_path=True)
    assert [m["step"] for m in from_source] == [3, 4, 5]
    assert from_source == from_resharded  # loss, lr, grad-norm of every step, bitwise (JSON floats round-trip)
    d = diff_checkpoints(final_source, final_resharded)
    assert d.equal, d.to_json()


def _save_then_reshard_then_load(ckpt_dir: str) -> dict:
    """At 4 ranks save; reshard to 3 (rank 0); at 3 ranks load and report which files each rank opened."""
    import torch.distributed as dist

    from mfsdp_ckpt.read import dcp_reader as storage

    model, optim = build("optim_grads_params", "row", seed=1)
    if dist.get_world_size() == 4:
        train_steps(model, optim, 0, 2)
        mfsdp_ckpt.save(os.path.join(ckpt_dir, "src"), model, optim, extra={"step": 2}, update_latest=False)
        return {}
    opened: dict[str, set[str]] = {}  # file -> keys read from it
    original = storage.VerifyingReader.read_data

    def spy(self, plan, planner):
        for req in plan.items:
            info = self.storage_data[req.storage_index]
            opened.setdefault(info.relative_path, set()).add(req.storage_index.fqn)
        return original(self, plan, planner)

    storage.VerifyingReader.read_data = spy
    try:
        mfsdp_ckpt.load(os.path.join(ckpt_dir, "w3"), model, optim)
    finally:
        storage.VerifyingReader.read_data = original
    return {"opened": opened, "pieces": owned_pieces(model, optim)}


@pytest.mark.heavy
def test_each_target_rank_reads_its_own_file(ranks, tmp_path):
    ranks(_save_then_reshard_then_load, 4, str(tmp_path))
    result = reshard(tmp_path / "src", tmp_path / "w3", world_size=3)
    assert result.files == 3
    out = ranks(_save_then_reshard_then_load, 3, str(tmp_path))
    for r, o in enumerate(out):
        own = o["opened"].pop(f"__{r}_0.distcp")
        assert any(k.startswith("model.") for k in own) and any(k.endswith(".exp_avg") for k in own)
        shared = o["opened"].pop("__0_0.distcp", set())
        assert not o["opened"], o["opened"]  # no other rank's file
        # from file 0 only the small entries every rank needs: step counters, param groups, extras
        assert all(k.startswith("extra.") or k == "optim.param_groups" or k.endswith(".step") for k in shared), shared
    # and the loaded state equals loading the source directly (asserted element by element)
    direct = ranks(_load_direct, 3, str(tmp_path))
    for a, b in zip(out, direct):
        for key, (lo, hi, values) in a["pieces"].items():
            assert (lo, hi) == b[key][:2] and torch.equal(values, b[key][2]), key


def _load_direct(ckpt_dir: str) -> dict:
    model, optim = build("optim_grads_params", "row", seed=1)
    mfsdp_ckpt.load(os.path.join(ckpt_dir, "src"), model, optim)
    return owned_pieces(model, optim)


def test_reshard_changes_strategy_policy_drops_optimizer_and_casts(source, tmp_path):
    dst = tmp_path / "bf16"
    result = reshard(
        source, dst, world_size=5, strategy="optim", policy="tensor", model_only=True, dtype="bfloat16", workers=2
    )
    assert result.files == 5 and any(k.startswith("optim.") for k in result.dropped)
    assert verify_checkpoint(dst) == []
    with CheckpointReader(dst) as out, CheckpointReader(source) as src:
        assert not [k for k in out.keys() if k.startswith(("optim.", "grad.", "extra.rng."))]
        for key in [k for k in src.keys() if k.startswith("model.")]:
            assert out.dtype(key) == torch.bfloat16
            assert torch.equal(out.read(key), src.read(key).to(torch.bfloat16)), key
        assert out.read("extra.step") == 2
        buffers = out.manifest["writer"]["plan"]["buffers"]
        assert {(g["strategy"], g["policy"], g["group_size"]) for g in buffers} == {("optim", "tensor", 5)}
        assert (
            out.manifest["has_optimizer"] is False
            and out.manifest["resharded_from"]["save_id"] == src.manifest["save_id"]
        )


def test_reshard_to_no_shard_writes_one_file_and_keeps_rng_at_same_world(source, tmp_path):
    result = reshard(source, tmp_path / "ns", world_size=4, strategy="no_shard")
    assert result.files == 1 and result.dropped == []
    assert diff_checkpoints(source, tmp_path / "ns", ignore=()).equal  # RNG states kept at the same world size


def test_the_recorded_plan_is_the_runtimes_plan_for_that_model(source):
    """What the trainer records is the plan ``fully_shard`` makes of the model (every field), and
    the plan import-hf records is the same planner's, with the defaults the trainer uses."""
    from cli.train import parse_args
    from mfsdp_ckpt.model.shape import default_plan

    with CheckpointReader(source) as reader:
        recorded = ModelPlan.from_dict(reader.manifest["writer"]["plan"])
        config = GPTConfig.from_dict(reader.manifest["model_config"])
    with torch.device("meta"):
        meta = GPTModel(config)
    assert recorded == plan_model(meta, shard_units(meta), policy="row", group_sizes={"dp": 4})
    args = parse_args([])
    imported = default_plan(config)
    assert {(b.strategy.value, str(b.policy)) for b in imported.buffers} == {(args.strategy, args.policy)}
    assert [b.fqns for b in imported.buffers] == [b.fqns for b in recorded.buffers]


def _without_plan(source: str, path, writer: dict, model_config) -> str:
    """The source's model weights in a checkpoint no sharded model wrote (as import-hf's)."""
    with CheckpointReader(source) as src:
        manifest = {
            "writer": writer,
            "model_config": model_config,
            "step": None,
            "include_grads": False,
            "has_optimizer": False,
            "versions": {},
        }
        with CheckpointBuilder(path, manifest) as b:
            for key in [k for k in src.keys() if k.startswith("model.")]:
                b.add_tensor(key, src.read(key))
            b.commit()
    return str(path)


def _assert_each_range_in_its_owners_file(ckpt: str, world: int) -> None:
    owners = _owner_files(ckpt)
    with CheckpointReader(ckpt) as reader:
        assert set(owners) == {k for k in reader.keys() if k.startswith("model.")}
    assert {r for pairs in owners.values() for _, r in pairs} == set(range(world))
    for key, pairs in owners.items():
        for file, r in pairs:
            assert file == f"__{r}_0.distcp", (key, file, r)


def test_reshard_takes_the_plan_of_another_checkpoint(source, tmp_path):
    """A checkpoint that records no plan (written before plans existed) reshards with the plan of
    another checkpoint of the same model: every range in its owner's file."""
    with CheckpointReader(source) as src:
        config = src.manifest["model_config"]
    ckpt = _without_plan(source, tmp_path / "src", {"world_size": 1}, config)
    _assert_refused(
        [ckpt, str(tmp_path / "out"), "--world-size", "3"], str(tmp_path / "out"), "records no placement plan"
    )
    res = CliRunner().invoke(main, ["reshard", ckpt, str(tmp_path / "w3"), "--world-size", "3", "--plan-from", source])
    assert res.exit_code == 0, res.output
    assert verify_checkpoint(tmp_path / "w3") == [] and diff_checkpoints(ckpt, tmp_path / "w3").equal
    _assert_each_range_in_its_owners_file(str(tmp_path / "w3"), 3)


def test_reshard_reads_plans_of_older_manifests(source, tmp_path):
    """Manifests written before the plan recorded ``writer.groups`` (names, strategy, policy, group
    size): reshard reads those, taking shapes and dtypes from the tensors."""
    with CheckpointReader(source) as src:
        plan = src.manifest["writer"]["plan"]
    groups = [
        {
            "params": b["params"],
            "strategy": b["strategy"],
            "policy": b["policy"],
            "group_size": b["group_size"],
            "is_expert": b["is_expert"],
        }
        for b in plan["buffers"]
    ]
    ckpt = _without_plan(source, tmp_path / "old", {"world_size": 4, "groups": groups}, None)
    result = reshard(ckpt, tmp_path / "w3", world_size=3)
    assert result.files == 3 and diff_checkpoints(ckpt, tmp_path / "w3").equal
    _assert_each_range_in_its_owners_file(str(tmp_path / "w3"), 3)


def test_reshard_without_a_plan(source, tmp_path):
    # recorded as "no buffers" (convert --to dcp of a plain state dict): everything whole, in file 0
    ckpt = _without_plan(source, tmp_path / "plain", {"world_size": 1, "buffers": [], "groups": []}, None)
    result = reshard(ckpt, tmp_path / "w3", world_size=3)
    assert result.files == 1 and diff_checkpoints(ckpt, tmp_path / "w3").equal
    # nothing recorded at all: refused in one line, even with a GPT model config (offline layouts
    # come from recorded plans, never from a model's code)
    with CheckpointReader(source) as src:
        config = src.manifest["model_config"]
    old = _without_plan(source, tmp_path / "old", {"world_size": 4}, config)
    _assert_refused(
        [old, str(tmp_path / "out"), "--world-size", "3"], str(tmp_path / "out"), "records no placement plan"
    )
    assert not os.path.exists(tmp_path / "out")
    # the plan of a checkpoint of another model: refused, naming what does not fit
    with CheckpointReader(source) as src:
        keep = [k for k in src.keys() if k.startswith("model.") and k != "model.output_layer.weight"]
        with CheckpointBuilder(tmp_path / "smaller", {"writer": {"world_size": 1}, "model_config": None}) as b:
            for key in keep:
                b.add_tensor(
                    key, src.read(key) if key != "model.embedding.word_embeddings.weight" else src.read(key)[:-1]
                )
            b.commit()
    _assert_refused(
        [str(tmp_path / "smaller"), str(tmp_path / "out"), "--world-size", "3", "--plan-from", source],
        str(tmp_path / "out"),
        "parameters with no 'model.' tensor: output_layer.weight; shape mismatch: embedding.word_embeddings.weight",
    )
    assert not os.path.exists(tmp_path / "out")


# ---- bad input: one line, exit 1 (usage: 2), nothing at DST ---------------------------------


def _assert_refused(args: list[str], dst: str, needle: str, code: int = 1) -> None:
    res = CliRunner().invoke(main, ["reshard", *args])
    assert res.exit_code == code, res.output
    assert needle in res.output, res.output
    if code == 1:
        assert len([line for line in res.output.splitlines() if line.strip()]) == 1, res.output
    parent = os.path.dirname(dst)
    if os.path.isdir(parent):
        assert not [n for n in os.listdir(parent) if ".partial-" in n], os.listdir(parent)


def test_bad_input(source, tmp_path):
    dst = str(tmp_path / "out")
    _assert_refused([str(tmp_path / "nope"), dst, "--world-size", "2"], dst, "no such checkpoint")
    os.makedirs(tmp_path / "empty")
    _assert_refused([str(tmp_path / "empty"), dst, "--world-size", "2"], dst, "not a checkpoint")
    _assert_refused([source, dst, "--world-size", "0"], dst, "--world-size must be >= 1")
    _assert_refused([source, dst, "--world-size", "-3"], dst, "--world-size must be >= 1")
    _assert_refused([source, dst, "--world-size", "2", "--policy", "block(32)"], dst, "not a multiple of 32")
    _assert_refused([source, dst, "--world-size", "2", "--strategy", "zero9"], dst, "unknown sharding strategy")
    _assert_refused([source, dst, "--world-size", "2", "--ep", "3"], dst, "--ep 3 does not divide --world-size 2")
    _assert_refused([source, dst, "--world-size", "2", "--ep", "two"], dst, "not a valid integer", code=2)
    _assert_refused([source, dst, "--world-size", "two"], dst, "not a valid integer", code=2)
    assert not os.path.exists(dst)

    # uncommitted: a save's .partial directory whose manifest was never written (a complete
    # directory without mfsdp.json is a stock DCP checkpoint, which reshard reads: test_stock_dcp.py)
    half = tmp_path / "run" / ".half.partial-0123456789ab"  # not next to DST: the refusal leaves no partial there
    shutil.copytree(source, half)
    os.remove(half / "mfsdp.json")
    _assert_refused([str(half), dst, "--world-size", "2"], dst, "never committed")
    assert not os.path.exists(dst)

    # a corrupt chunk: named by file and key, nothing left at DST
    bad = tmp_path / "bad"
    shutil.copytree(source, bad)
    with CheckpointReader(bad) as r:
        index, info = next((i, s) for i, s in r.metadata.storage_data.items() if i.fqn == "model.output_layer.weight")
    with open(bad / info.relative_path, "r+b") as f:
        f.seek(info.offset + info.length // 2)  # inside the tensor bytes
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    _assert_refused([str(bad), dst, "--world-size", "3"], dst, "model.output_layer.weight")
    res = CliRunner().invoke(main, ["reshard", str(bad), dst, "--world-size", "3"])
    assert info.relative_path in res.output and "checksum mismatch" in res.output, res.output
    assert not os.path.exists(dst)

    # DST exists: refused, untouched; --overwrite replaces it
    os.makedirs(dst)
    with open(os.path.join(dst, "keep.txt"), "w") as f:
        f.write("mine")
    _assert_refused([source, dst, "--world-size", "2"], dst, "already exists")
    assert os.listdir(dst) == ["keep.txt"]
    out = _cli_subprocess("reshard", source, dst, "--world-size", "2")
    assert out.returncode == 1 and out.stderr.startswith("error: ") and "already exists" in out.stderr
    # --overwrite replaces a checkpoint, never a directory of other files (they would be lost)
    _assert_refused([source, dst, "--world-size", "2", "--overwrite"], dst, "is not a checkpoint directory")
    assert os.listdir(dst) == ["keep.txt"]
    os.remove(os.path.join(dst, "keep.txt"))
    assert CliRunner().invoke(main, ["reshard", source, dst, "--world-size", "3"]).exit_code == 1  # exists (empty)
    res = CliRunner().invoke(main, ["reshard", source, dst, "--world-size", "3", "--overwrite"])
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(main, ["reshard", source, dst, "--world-size", "2", "--overwrite"])
    assert res.exit_code == 0, res.output
    assert verify_checkpoint(dst) == [] and len([n for n in os.listdir(dst) if n.endswith(".distcp")]) == 2
