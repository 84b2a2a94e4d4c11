"""A save's metadata grows with tensors, not ranks × tensors, and our readers never open
``.metadata`` (the index in ``mfsdp.json`` and the data files' record tables say everything),
while stock PyTorch tools still read the checkpoint through ``.metadata``.

A model of 96 Linear layers (192 tensors + AdamW state), ZeRO-3, saved by real processes at 2
and at 6 ranks: everything but the data files and ``.metadata`` grows at most 1.3×; a load at 4
ranks opens no ``.metadata`` and gets the saved values bitwise; ``dcp_to_torch_save`` reads the
checkpoint."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn

import mfsdp_ckpt
from mfsdp_ckpt.read.reader import CheckpointReader
from mfsdp_ckpt.tools.inspect import verify_checkpoint
from mfsdp_core import describe_shards, fully_shard, fully_shard_optimizer

LAYERS = 96


class Stack(nn.Module):
    """96 Linear layers of uneven sizes (so shards cut inside tensors and some are empty)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8 + i % 5, 8 + (i + 1) % 5) for i in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x[..., : layer.in_features])
        return x


def _build():
    torch.manual_seed(0)
    model = Stack()
    for layer in model.layers:
        fully_shard(layer, strategy="optim_grads_params")
    model = fully_shard(model, strategy="optim_grads_params")
    return model, fully_shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))


def _save(path: str) -> None:
    model, optim = _build()
    x = torch.randn(4, 12, generator=torch.Generator().manual_seed(dist.get_rank()))
    model(x).square().sum().backward()
    optim.step()
    mfsdp_ckpt.save(path, model, optim, step=1)


def _load_watching_opens(path: str) -> dict:
    opened: list[str] = []

    def audit(event: str, args: tuple) -> None:
        if event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
            opened.append(os.fsdecode(args[0]))

    sys.addaudithook(audit)  # stays for this rank's process only (it ends with the test)
    model, optim = _build()
    mfsdp_ckpt.load(path, model, optim)
    pieces = {}
    for ps in describe_shards(model, optim):
        lo, hi = ps.owned
        pieces[ps.fqn] = (lo, hi, ps.main.tensor.clone(), ps.optim["exp_avg"].tensor.clone())
    return {
        "metadata_opens": [p for p in opened if p.endswith(".metadata")],
        "data_opens": len(opened),
        "pieces": pieces,
    }


def _small_files_bytes(path: str) -> int:
    return sum(
        os.path.getsize(os.path.join(path, n))
        for n in os.listdir(path)
        if not n.endswith(".distcp") and n != ".metadata"
    )


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[int, str]:
    from tests.harness import run_ranks

    root = tmp_path_factory.mktemp("scale")
    out = {}
    for world in (2, 6):
        out[world] = str(root / f"w{world}")
        run_ranks(_save, world, out[world], timeout=300)
    return out


def test_metadata_beside_the_data_grows_with_tensors_not_ranks(saved):
    small = {w: _small_files_bytes(p) for w, p in saved.items()}
    stock = {w: os.path.getsize(os.path.join(p, ".metadata")) for w, p in saved.items()}
    assert small[6] <= 1.3 * small[2], (small, stock)
    assert stock[6] > 2 * stock[2], stock  # the stock metadata lists every chunk of every rank
    for p in saved.values():
        assert verify_checkpoint(p) == []


def test_a_load_at_four_ranks_opens_no_metadata_and_is_bitwise(ranks, saved):
    path = saved[6]
    out = ranks(_load_watching_opens, 4, path, timeout=300)
    with CheckpointReader(path) as reader:
        for r in out:
            assert r["metadata_opens"] == [], r["metadata_opens"]
            assert r["data_opens"] > 0
            for fqn, (lo, hi, main, exp_avg) in r["pieces"].items():
                assert torch.equal(main, reader.read(f"model.{fqn}").reshape(-1)[lo:hi]), fqn
                assert torch.equal(exp_avg, reader.read(f"optim.{fqn}.exp_avg").reshape(-1)[lo:hi]), fqn


def test_stock_dcp_to_torch_save_reads_it(saved, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = saved[6]
    out = str(tmp_path / "full.pt")
    dcp_to_torch_save(path, out)
    full = torch.load(out, weights_only=True)
    with CheckpointReader(path) as reader:
        keys = [k for k in reader.keys() if reader.is_tensor(k)]
        assert len([k for k in keys if k.startswith("model.")]) == 2 * LAYERS
        for key in keys:
            assert torch.equal(full[key], reader.read(key)), key
