"""Which modules of ``mfsdp_ckpt`` a save and a load pass through: a trace of every Python call.

Run twice under torchrun, a save at one world size and a load at another:

    .venv/bin/torchrun --standalone --nproc-per-node 2 bench/trace_save_load.py save /tmp/trace_ckpt
    .venv/bin/torchrun --standalone --nproc-per-node 3 bench/trace_save_load.py load /tmp/trace_ckpt

Rank 0 prints, for its own process: the modules of ``mfsdp_ckpt`` that ran (in the order first
entered), how often the call sequence switched from one module to another, and how many times
the DCP metadata was unpickled (calls of ``safe_load_metadata``) and asked for (calls of a
reader's ``read_metadata``). Only the public API is used
(``mfsdp_ckpt.save`` / ``load``), so the same script traces any version of the package.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import mfsdp_ckpt
from mfsdp_core import fully_shard, fully_shard_optimizer

PACKAGE = os.path.dirname(os.path.abspath(mfsdp_ckpt.__file__))


def build() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    dims = [48, 40, 48, 40, 48, 13]  # sizes that 2 and 3 ranks do not divide evenly
    model = nn.Sequential(*[nn.Linear(a, b) for a, b in zip(dims, dims[1:])])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optim = fully_shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    model(torch.randn(2, 48)).sum().backward()
    optim.step()
    return model, optim


class Trace:
    """The calls into ``mfsdp_ckpt`` while active: module order, switches, metadata reads."""

    def __init__(self) -> None:
        self.modules: list[str] = []
        self.switches = 0
        self.metadata_reads = 0
        self.metadata_asks = 0  # calls of a reader's read_metadata (each may return what it read before)
        self._last: str | None = None

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if event != "call":
            return
        path = frame.f_code.co_filename
        if not path.startswith(PACKAGE):
            return
        module = os.path.relpath(path, os.path.dirname(PACKAGE))[:-3].replace(os.sep, ".")
        if module not in self.modules:
            self.modules.append(module)
        if self._last is not None and module != self._last:
            self.switches += 1
        self._last = module
        if frame.f_code.co_name == "safe_load_metadata":
            self.metadata_reads += 1
        if frame.f_code.co_name == "read_metadata":
            self.metadata_asks += 1


def main() -> None:
    what, path = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    model, optim = build()
    trace = Trace()
    sys.setprofile(trace)
    try:
        if what == "save":
            mfsdp_ckpt.save(path, model, optim, overwrite=True)
        else:
            mfsdp_ckpt.load(path, model, optim)
    finally:
        sys.setprofile(None)
    if dist.get_rank() == 0:
        print(
            f"{what} at world size {dist.get_world_size()}: {len(trace.modules)} modules, {trace.switches} module "
            f"switches, {trace.metadata_reads} metadata reads, {trace.metadata_asks} read_metadata calls"
        )
        print("  " + " > ".join(m.removeprefix("mfsdp_ckpt.") for m in trace.modules))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
