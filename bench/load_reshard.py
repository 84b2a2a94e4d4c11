"""Load-time resharding benchmark: loading one checkpoint into other layouts costs no more than
loading it into the layout that wrote it.

A checkpoint saved by ``--layers`` × Linear(``--dim``, ``--dim``) + AdamW, each Linear its own
unit, sharded ``even`` with ZeRO-3, is loaded (warm page cache: this measures the planning,
reading and copying, not the disk) into models sharded as:

- the same layout (``even``, ZeRO-3): the reference;
- ``row``, ZeRO-1;
- ``tensor``, ZeRO-2 (whole parameters; each one-parameter unit is owned by one rank).

Each target is also loaded from a checkpoint saved in its own layout, so that the cost of the
resharding itself shows apart from the cost of the target layout (ZeRO-1/2 gather the compute
weights after a load; ZeRO-3 does not). Median of ``--rounds`` loads each, the slowest rank's
time; prints the ratios to the same-layout load of the ``even``/ZeRO-3 checkpoint and to the load
of the target's own checkpoint (target: at most 1.1), and how many elements each rank owns.

    .venv/bin/torchrun --standalone --nproc-per-node 2 bench/load_reshard.py --dir /tmp/load_reshard_bench
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

import mfsdp_ckpt
from mfsdp_core import describe_shards, fully_shard, fully_shard_optimizer

LAYOUTS = [("even", "optim_grads_params"), ("row", "optim"), ("tensor", "optim_grads")]


def build(layers: int, dim: int, policy: str, strategy: str):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(dim, dim, bias=False) for _ in range(layers)])
    for layer in model:
        fully_shard(layer, policy=policy, strategy=strategy)
    fully_shard(model, policy=policy, strategy=strategy)
    optim = fully_shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))
    model(torch.randn(2, dim)).sum().backward()
    optim.step()
    optim.zero_grad()
    return model, optim


def slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/tmp/mfsdp_load_reshard_bench")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(args.dir, ignore_errors=True)
    dist.barrier()
    targets = {f"{p}/{s}": build(args.layers, args.dim, p, s) for p, s in LAYOUTS}
    own = {name: os.path.join(args.dir, name.replace("/", "_")) for name in targets}
    for name, (model, optim) in targets.items():
        mfsdp_ckpt.save(own[name], model, optim, update_latest=False)
    path = own[next(iter(targets))]  # the even/ZeRO-3 checkpoint
    times: dict[tuple[str, str], list[float]] = {}
    owned: dict[str, int] = {}
    runs = [(name, source) for name in targets for source in dict.fromkeys([path, own[name]])]
    for name, source in runs:  # warm the page cache and the code paths
        mfsdp_ckpt.load(source, *targets[name])
        owned[name] = sum(hi - lo for ps in describe_shards(*targets[name]) for lo, hi in [ps.owned])
    for r in range(args.rounds):  # rotate the order each round
        for name, source in runs[r % len(runs) :] + runs[: r % len(runs)]:
            dist.barrier()
            start = time.perf_counter()
            mfsdp_ckpt.load(source, *targets[name])
            times.setdefault((name, source), []).append(slowest(time.perf_counter() - start))
    counts = [None] * dist.get_world_size()
    dist.all_gather_object(counts, owned)
    if rank == 0:
        reference = statistics.median(times[(next(iter(targets)), path)])
        print(
            f"{args.layers} x Linear({args.dim},{args.dim}) + AdamW on {dist.get_world_size()} ranks; warm loads, "
            f"median of {args.rounds}; 'own' = a checkpoint saved in the target's layout"
        )
        print(
            f"{'target layout':24s} {'from even/ZeRO-3':>17s} {'vs same layout':>15s} {'from own':>9s} {'reshard vs own':>15s}  "
            "elements owned per rank"
        )
        for name in targets:
            t = statistics.median(times[(name, path)])
            t_own = statistics.median(times[(name, own[name])])
            print(
                f"{name:24s} {t:17.3f} {t / reference:15.2f} {t_own:9.3f} {t / t_own:15.2f}  {[c[name] for c in counts]}"
            )
        shutil.rmtree(args.dir, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
