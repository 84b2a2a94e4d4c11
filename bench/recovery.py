"""Recovery from the memory tier against a cold restore of the same step from a durable checkpoint,
and what the snapshots cost the training loop. Run under torchrun::

    .venv/bin/torchrun --standalone --nproc-per-node 2 bench/recovery.py --model gpt50m
    .venv/bin/torchrun --standalone --nproc-per-node 4 bench/recovery.py --model tiny-moe

One run prints, medians over ``--rounds``:

- ``snapshot``: seconds one background snapshot (``mfsdp_ckpt.tier.async_snapshot``, as the
  trainer takes them) blocks the loop (the call, and the optimizer step's wait for the copy), as
  a share of a step, and its total time (copy, write, replication to the peer node, commit);
- ``restore``: a fresh model restored from the memory tier (``recover``: survey with crc32c of
  every file, load) against the same step loaded from a durable checkpoint on disk
  (``mfsdp_ckpt.load`` after evicting its files from the page cache), and the ratio; with
  ``--s3 s3://BUCKET``, also against the same step loaded from an object store (saved there
  outside the timing);
- the loop's step time without snapshots, with one every 10 steps and with one every step;
- peak RSS;
- time lost per failure at a failure rate of one per ``--mtbf-steps`` steps: the mean redone
  steps (half the interval) times the step time, plus the restore, for ``--mem-every 1`` and
  for durable saves every 50 steps (the restart of the processes, the same for both, is not
  counted).

Nodes: ``--node-size`` ranks each (default half the ranks: two nodes, one replica each).

A durable copy on a local disk reads back here at close to memory speed even with its pages
evicted, and a restore from the tier is a load of the same format from a tmpfs, so that ratio
stays near 1; what the tier saves is the distance to the durable store. ``--s3`` measures one
such distance. Against a local S3 server (moto on loopback, started as in ``ckpt_io.py``'s
docstring) it is the client path and moto's own speed, not a real object store's::

    .venv/bin/torchrun --standalone --nproc-per-node 2 bench/recovery.py --model gpt50m --s3 s3://bench
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import resource
import shutil
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from pagecache import drop_cache  # bench/ (the script's directory)

import mfsdp_ckpt
from mfsdp_ckpt.storage import fs
from mfsdp_ckpt.tier import MemoryTier, async_snapshot, recover
from mfsdp_core import fully_shard, fully_shard_optimizer
from mfsdp_core.models.gpt import GPTModel, get_preset, shard_units

MODELS = {
    # about 50M parameters: 8 layers of 512, a 32k vocabulary
    "gpt50m": dataclasses.replace(
        get_preset("tiny"),
        vocab_size=32000,
        hidden_size=512,
        num_layers=8,
        num_attention_heads=8,
        num_query_groups=8,
        kv_channels=64,
        ffn_hidden_size=2048,
        seq_length=256,
    ),
    "tiny-moe": get_preset("tiny-moe"),
}


def build(config, seed: int):
    torch.manual_seed(seed)
    model = GPTModel(config)
    for unit in shard_units(model):
        fully_shard(unit)
    return model, fully_shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))


def train_step(model, optim, config, batch: int, step: int) -> None:
    g = torch.Generator().manual_seed(step * 1000 + dist.get_rank())
    tokens = torch.randint(0, config.vocab_size, (batch, 65), generator=g)
    logits = model(tokens[:, :-1])
    aux = getattr(model, "aux_loss", 0.0)
    (F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)) + aux).backward()
    optim.step()
    optim.zero_grad()


def timed(fn, *args, **kwargs) -> float:
    """Seconds of ``fn(*args, **kwargs)`` on the slowest rank (a barrier each side)."""
    dist.barrier()
    start = time.perf_counter()
    fn(*args, **kwargs)
    dist.barrier()
    return time.perf_counter() - start


def _recover_into(out: list, tier: MemoryTier, model, optim) -> None:
    out.append(recover(tier, model, optim))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(MODELS), default="gpt50m")
    p.add_argument("--dir", default="/tmp/mfsdp_bench_recovery", help="the durable checkpoints (a disk)")
    p.add_argument("--tier", default="/dev/shm/mfsdp_bench_recovery", help="the memory tier (a tmpfs)")
    p.add_argument("--node-size", type=int, default=None)
    p.add_argument("--batch", type=int, default=2, help="sequences per rank per step")
    p.add_argument("--steps", type=int, default=20, help="timed steps per loop measurement")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--mtbf-steps", type=int, default=1000)
    p.add_argument("--s3", default=None, help="also restore cold from a durable copy under this s3:// prefix")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    config = MODELS[args.model]
    node_size = args.node_size or max(world // 2, 1)
    if rank == 0:
        for d in (args.dir, args.tier):
            shutil.rmtree(d, ignore_errors=True)
    dist.barrier()
    tier = MemoryTier(args.tier, "bench", node_size=node_size, keep=2, replicas=1)
    model, optim = build(config, 0)
    train_step(model, optim, config, args.batch, 0)

    handles: list = []

    def loop(every: int | None, first: int) -> float:
        def run() -> None:
            for s in range(first, first + args.steps):
                train_step(model, optim, config, args.batch, s)
                if every and s % every == 0:
                    if handles:
                        handles[-1].result()
                    handles.append(async_snapshot(tier, s, model, optim, extra={"step": s}))
            if handles:
                handles[-1].result()

        return timed(run) / args.steps

    results: dict[str, list[float]] = {
        k: [] for k in ("step", "step_mem10", "step_mem1", "blocked", "snap", "save", "cold", "cold_s3", "tier")
    }
    for r in range(args.rounds):
        base = 1000 * (r + 1)
        results["step"].append(loop(None, base))
        results["step_mem10"].append(loop(10, base + 100))
        handles.clear()
        results["step_mem1"].append(loop(1, base + 200))
        results["blocked"].append(statistics.median(h.blocked_s for h in handles[1:]))
        results["snap"].append(statistics.median(h.total_s for h in handles[1:]))
        step = base + 200 + args.steps - 1  # the newest snapshot
        durable = os.path.join(args.dir, f"step_{step:06d}")
        results["save"].append(timed(mfsdp_ckpt.save, durable, model, optim, extra={"step": step}))
        fresh, fresh_optim = build(config, 1)
        if rank == 0:
            drop_cache(durable)
        results["cold"].append(timed(mfsdp_ckpt.load, durable, fresh, fresh_optim))
        if args.s3:
            remote = f"{args.s3.rstrip('/')}/mfsdp_bench_recovery/step_{step:06d}"
            mfsdp_ckpt.save(remote, model, optim, extra={"step": step})
            fresh, fresh_optim = build(config, 3)
            results["cold_s3"].append(timed(mfsdp_ckpt.load, remote, fresh, fresh_optim))
            if rank == 0:
                fs.remove_tree(remote)
        fresh, fresh_optim = build(config, 2)
        got: list = []
        results["tier"].append(timed(_recover_into, got, tier, fresh, fresh_optim))
        assert got[0].step == step, got[0]
    med = {k: statistics.median(v) for k, v in results.items() if v}
    peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0])
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if rank == 0:
        params = sum(p.numel() for p in GPTModel(config).parameters())
        mtbf = args.mtbf_steps
        lost_mem = 0.5 * 1 * med["step_mem1"] + med["tier"]
        lost_durable = 0.5 * 50 * med["step"] + med["cold"]
        print(
            f"model {args.model} ({params / 1e6:.1f}M parameters), {world} ranks, nodes of {node_size}, {args.rounds} rounds"
        )
        print(
            f"snapshot: blocks {med['blocked'] * 1e3:.1f} ms = {med['blocked'] / med['step']:.1%} of a step, "
            f"total {med['snap']:.3f} s in the background; a durable save (synchronous) {med['save']:.3f} s"
        )
        print(
            f"restore: memory tier {med['tier']:.3f} s, cold durable load {med['cold']:.3f} s: "
            f"{med['cold'] / med['tier']:.2f}x"
            + (
                f"; cold load from {args.s3} {med['cold_s3']:.3f} s: {med['cold_s3'] / med['tier']:.2f}x"
                if args.s3
                else ""
            )
        )
        print(
            f"step {med['step'] * 1e3:.1f} ms; --mem-every 10: {med['step_mem10'] * 1e3:.1f} ms "
            f"({med['step_mem10'] / med['step'] - 1:+.1%}); --mem-every 1: {med['step_mem1'] * 1e3:.1f} ms "
            f"({med['step_mem1'] / med['step'] - 1:+.1%})"
        )
        print(f"peak RSS per rank {peak.item():.0f} MiB")
        print(
            f"time lost per failure (redone steps + restore, restart not counted): --mem-every 1 {lost_mem:.2f} s, "
            f"durable every 50 steps {lost_durable:.2f} s; per {mtbf} steps of training: "
            f"{lost_mem / (mtbf * med['step_mem1']):.2%} vs {lost_durable / (mtbf * med['step']):.2%}"
        )
    dist.barrier()
    if rank == 0:
        for d in (args.dir, args.tier):
            shutil.rmtree(d, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
