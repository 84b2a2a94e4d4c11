"""Muon optimizer step at W = 4 ranks: whole matrices (``tensor`` placement), owner-compute (``even``
placement), and the naive baseline that gathers every full matrix on every rank, in one run.

    .venv/bin/torchrun --standalone --nproc-per-node 4 bench/muon_step.py

A GPT-style model (hidden 512, 4 layers, SwiGLU 1536: 16 Muon matrices), ZeRO-3. Each mode gets
its own model with the same seed and gradients; the rounds rotate the order; each reports the
median optimizer-step time, its ratio to the baseline (> 1: faster), and per rank the bytes its
step communicates (the comm counter's). The baseline updates momentum on the local pieces,
all-gathers each buffer's momentum, runs Newton–Schulz on every matrix on every rank, and keeps
its own piece of each update: what a Muon that ignores ownership costs.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mfsdp_core import collectives as C
from mfsdp_core import count_comm, fully_shard, fully_shard_optimizer
from mfsdp_core.models.gpt import GPTModel, get_preset, shard_units
from mfsdp_core.muon import Muon, muon_param_groups, newton_schulz5
from mfsdp_core.optim import shard_of


def build(config, policy: str):
    torch.manual_seed(0)
    model = GPTModel(config)
    for unit in shard_units(model):
        fully_shard(unit, policy=policy)
    return model, fully_shard_optimizer(Muon(muon_param_groups(model), ns_dtype="bfloat16"))


@torch.no_grad()
def gather_all_step(optim: Muon) -> None:
    """The baseline: every rank gathers every Muon matrix whole and orthogonalizes all of them."""
    muon = [p for g in optim.param_groups if g["use_muon"] for p in g["params"]]
    group = next(g for g in optim.param_groups if g["use_muon"])
    by_buffer: dict = {}
    for p in muon:
        state = optim.state.setdefault(p, {})
        buf = state.setdefault("momentum_buffer", torch.zeros_like(p))
        buf.mul_(group["momentum"]).add_(p.grad)
        owner = shard_of(optim, p)
        by_buffer.setdefault(owner[0], []).append((p, owner[1], (buf * group["momentum"]).add_(p.grad)))
    for fb, items in by_buffer.items():
        layout = fb.layout
        shard = torch.zeros(layout.shard_size)
        for _, i, u in items:
            pc = fb.local_piece(i)
            shard[pc.shard_offset : pc.shard_offset + pc.numel] = u
        full = torch.empty(layout.gathered_size)
        C.all_gather(full, shard, fb.shard_group)
        for p, i, _ in items:
            whole = torch.empty(layout.numels[i])
            for pc in layout.owners(i):
                pos = pc.rank * layout.shard_size + pc.shard_offset
                whole[pc.start : pc.end] = full[pos : pos + pc.numel]
            rows, cols = layout.shapes[i]
            update = newton_schulz5(whole.view(rows, cols), group["ns_steps"], torch.bfloat16).reshape(-1)
            pc = fb.local_piece(i)
            p.mul_(1 - group["lr"] * group["weight_decay"])
            p.sub_(update[pc.start : pc.end].float() * (group["lr"] * max(1.0, rows / cols) ** 0.5))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--ffn", type=int, default=1536)
    p.add_argument("--steps", type=int, default=3, help="timed optimizer steps per round")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    config = dataclasses.replace(
        get_preset("llama-like-small"),
        hidden_size=args.hidden,
        num_layers=args.layers,
        ffn_hidden_size=args.ffn,
        num_attention_heads=8,
        num_query_groups=4,
        kv_channels=args.hidden // 8,
    )
    modes = {
        "gather-all": build(config, "even"),
        "owner-compute": build(config, "even"),
        "tensor": build(config, "tensor"),
    }
    tokens = torch.randint(0, config.vocab_size, (2, 65), generator=torch.Generator().manual_seed(rank))
    for model, _ in modes.values():  # gradients to step on (kept: the steps below do not zero them)
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)).backward()

    def run(name: str) -> None:
        optim = modes[name][1]
        if name == "gather-all":
            gather_all_step(optim)
        else:
            optim.step()

    comm = {}
    for name in modes:  # warm-up, and one counted step (the post-step refresh gathers nothing under ZeRO-3)
        run(name)
        with count_comm() as counter:
            run(name)
        comm[name] = counter.total_bytes()
    times: dict[str, list[float]] = {name: [] for name in modes}
    names = list(modes)
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.steps):
                run(name)
            dist.barrier()
            times[name].append((time.perf_counter() - start) / args.steps)
    if rank == 0:
        matrices = sum(1 for g in modes["tensor"][1].param_groups if g["use_muon"] for _ in g["params"])
        print(
            f"W={world}, {matrices} Muon matrices (hidden {args.hidden}, {args.layers} layers, FFN {args.ffn}), ZeRO-3, "
            f"bf16 Newton-Schulz, gloo on CPU; median of {args.rounds} rounds x {args.steps} steps"
        )
        print(f"{'mode':<14} {'step ms':>9} {'vs gather-all':>14} {'rank 0 comm MB/step':>20}")
        ref = statistics.median(times["gather-all"])
        for name in modes:
            t = statistics.median(times[name])
            print(f"{name:<14} {t * 1e3:>9.1f} {ref / t:>14.2f} {comm[name] / 1e6:>20.2f}")
    modes.clear()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
