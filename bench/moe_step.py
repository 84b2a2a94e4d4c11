"""MoE training step time at W = 4 ranks with EP = 1, 2 and 4, in one run.

    .venv/bin/torchrun --standalone --nproc-per-node 4 bench/moe_step.py

A GPT-style MoE with 16 experts per layer (top-2, no shared expert), ZeRO-3, AdamW. Each EP size
gets its own model (same seed); the rounds rotate the order, and each reports the median step
time over its rounds, its ratio to EP = 1 (> 1: faster), and per rank and step the bytes of
token all-to-all and of parameter all-gathers (the comm counter's logical bytes) and the expert
parameters the rank holds. On CPU with gloo this shows the communication each layout costs, not
GPU speed: here every "rank" shares the same few cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mfsdp_core import count_comm, fully_shard, fully_shard_optimizer
from mfsdp_core.expert_parallel import expert_index, expert_placement, init_expert_mesh
from mfsdp_core.models.gpt import GPTModel, get_preset, shard_experts, shard_units


def build(config, ep: int):
    mesh = init_expert_mesh(ep, config.num_experts)
    torch.manual_seed(0)
    model = shard_experts(GPTModel(config), mesh)
    for unit in shard_units(model):
        fully_shard(unit, mesh=mesh.groups, placement=expert_placement())
    optim = fully_shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))
    return model, optim


def step(model, optim, tokens: torch.Tensor) -> None:
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    (loss + model.aux_loss).backward()
    optim.step()
    optim.zero_grad()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=512, help="hidden size of each expert")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seqs", type=int, default=4, help="sequences per rank")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=4, help="timed steps per round")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    base = get_preset("mixtral-like-small")
    config = dataclasses.replace(
        base,
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_experts=args.experts,
        moe_ffn_hidden_size=args.ffn,
        num_attention_heads=8,
        num_query_groups=2,
        kv_channels=args.hidden // 8,
        seq_length=args.seq_len,
    )
    sizes = [ep for ep in (1, 2, 4) if world % ep == 0 and args.experts % ep == 0]
    runs = {ep: build(config, ep) for ep in sizes}
    gen = torch.Generator().manual_seed(rank)
    batch = lambda: torch.randint(0, config.vocab_size, (args.seqs, args.seq_len + 1), generator=gen)  # noqa: E731
    times: dict[int, list[float]] = {ep: [] for ep in sizes}
    comm: dict[int, tuple[int, int]] = {}
    for ep in sizes:  # warm-up, and one counted step
        model, optim = runs[ep]
        step(model, optim, batch())
        with count_comm() as counter:
            step(model, optim, batch())
        comm[ep] = (counter.total_bytes("all_to_all"), counter.total_bytes("all_gather"))
    for r in range(args.rounds):
        order = sizes[r % len(sizes) :] + sizes[: r % len(sizes)]
        for ep in order:
            model, optim = runs[ep]
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.steps):
                step(model, optim, batch())
            dist.barrier()
            times[ep].append((time.perf_counter() - start) / args.steps)
    if rank == 0:
        experts = {
            ep: sum(p.numel() for n, p in runs[ep][0].named_parameters() if expert_index(n) is not None) for ep in sizes
        }
        print(
            f"W={world}, {args.experts} experts x {args.layers} layers (hidden {args.hidden}, expert ffn {args.ffn}), "
            f"{args.seqs}x{args.seq_len} tokens per rank, ZeRO-3, gloo on CPU; median of {args.rounds} rounds x {args.steps} steps"
        )
        print(
            f"{'EP':>3} {'step ms':>9} {'vs EP=1':>8} {'all-to-all MB/step':>19} {'all-gather MB/step':>19} {'expert params/rank':>19}"
        )
        ref = statistics.median(times[sizes[0]])
        for ep in sizes:
            t = statistics.median(times[ep])
            print(
                f"{ep:>3} {t * 1e3:>9.1f} {ref / t:>8.2f} {comm[ep][0] / 1e6:>19.2f} {comm[ep][1] / 1e6:>19.2f} {experts[ep]:>19,}"
            )
    runs.clear()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
