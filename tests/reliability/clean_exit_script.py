"""Save once, load into three other layouts, exit: the process must exit 0, not abort.

Run under ``torchrun --standalone --nproc-per-node 2`` (gloo, CPU)::

    torchrun --standalone --nproc-per-node 2 tests/reliability/clean_exit_script.py CKPT_DIR

Builds 12 ``fully_shard``-ed Linear layers with AdamW (ZeRO-3, ``even``), trains one step, saves
once into ``CKPT_DIR/step_1``, loads that checkpoint into three models of other layouts
(``no_shard``/``row``, ``optim``/``tensor``, ``optim_grads``/``row``) and compares their outputs,
gathers every rank's verdict (one last collective), calls ``destroy_process_group()`` and returns.

``tests/reliability/test_clean_exit.py`` runs it repeatedly and requires every rank to exit 0. A
process group that outlives ``destroy_process_group()`` (the models' buffers used to keep it alive
for good) still has gloo worker threads at interpreter exit; one still releasing the tensors of
that last collective needs the GIL there, is stopped by the interpreter with ``pthread_exit``
inside a C++ destructor and the process dies with SIGABRT ("terminate called without an active
exception"): a job that did its work looks failed to every scheduler.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import mfsdp_ckpt
from mfsdp_core import fully_shard, fully_shard_optimizer

LAYERS = 12
WIDTH = 24


def build(strategy: str, policy: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The same 12-layer model (same seed on every rank), sharded with ``strategy`` / ``policy``."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    for layer in model:
        fully_shard(layer, strategy=strategy, policy=policy)
    fully_shard(model, strategy=strategy, policy=policy)
    optim = fully_shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    return model, optim


def main() -> int:
    """Train one step, save, load into three other layouts, compare outputs, tear down; 0 when
    every rank's loaded models computed what the saved one did."""
    ckpt_dir = sys.argv[1]
    dist.init_process_group("gloo")
    model, optim = build("optim_grads_params", "even")
    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(1 + dist.get_rank()))
    model(x).square().mean().backward()
    optim.step()
    optim.zero_grad()
    path = mfsdp_ckpt.save(os.path.join(ckpt_dir, "step_1"), model, optim, extra={"step": 1})
    probe = torch.randn(2, WIDTH, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected = model(probe)
    faults = []
    for strategy, policy in (("no_shard", "row"), ("optim", "tensor"), ("optim_grads", "row")):
        other, other_optim = build(strategy, policy)
        extra = mfsdp_ckpt.load(path, other, other_optim)
        with torch.no_grad():
            got = other(probe)
        if extra.get("step") != 1 or not torch.equal(got, expected):
            faults.append(f"{strategy}/{policy}: step {extra.get('step')}, outputs equal: {torch.equal(got, expected)}")
    rank = dist.get_rank()
    print(f"rank {rank}: {'ok' if not faults else 'FAILED'}", flush=True)
    # every rank's verdict, in one collective right before exit: a collective finishing just
    # before interpreter shutdown is what exposes a process group left alive past it
    verdicts: list[list[str]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(verdicts, faults)
    dist.destroy_process_group()
    failed = [f"rank {r}: {f}" for r, fs in enumerate(verdicts) for f in fs]
    if failed and rank == 0:
        print("\n".join(failed), file=sys.stderr, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
