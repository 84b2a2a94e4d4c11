"""A small sharded training run: ``torchrun --nproc-per-node 2 -m mfsdp_core.train``.

Trains :class:`~mfsdp_core.models.toy.TinyLM` on a synthetic, learnable token stream (a fixed
random Markov chain) with ``fully_shard`` on every block and the root, AdamW through
``fully_shard_optimizer``, and gradient clipping; rank 0 prints the loss of every step.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import clip_grad_norm_, fully_shard, fully_shard_optimizer
from .layout import parse_policy
from .models.toy import TinyLM
from .strategy import STRATEGY_NAMES, parse_strategy


def markov_batch(step: int, batch: int, seq_len: int, vocab: int, seed: int) -> torch.Tensor:
    """Batch ``step`` of a deterministic token stream: each token follows from the previous one
    through a fixed sparse transition table, so there is something to learn."""
    table_gen = torch.Generator().manual_seed(seed)
    successors = torch.randint(vocab, (vocab, 4), generator=table_gen)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    tokens = torch.empty(batch, seq_len + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(vocab, (batch,), generator=gen)
    choice = torch.randint(4, (batch, seq_len), generator=gen)
    for t in range(seq_len):
        tokens[:, t + 1] = successors[tokens[:, t], choice[:, t]]
    return tokens


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="mfsdp_core.train", description=__doc__.splitlines()[0])
    p.add_argument("--strategy", default="optim_grads_params", help=f"one of {', '.join(STRATEGY_NAMES)}")
    p.add_argument("--policy", default="even", help="even, row, block(N) or tensor")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--batch-size", type=int, default=8, help="global batch (sequences); split over ranks")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--clip", type=float, default=1.0, help="max global grad norm")
    args = p.parse_args(argv)
    try:
        parse_strategy(args.strategy)
        parse_policy(args.policy)
    except ValueError as e:
        p.error(str(e))
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    if args.batch_size % world:
        raise SystemExit(f"--batch-size {args.batch_size} must be a multiple of the world size {world}")
    torch.manual_seed(args.seed)
    model = TinyLM()
    for block in model.blocks:
        fully_shard(block, strategy=args.strategy, policy=args.policy)
    fully_shard(model, strategy=args.strategy, policy=args.policy)
    optim = fully_shard_optimizer(torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01))
    if rank == 0:
        print(f"world size {world}, strategy {args.strategy}, policy {args.policy}", flush=True)
    for step in range(1, args.steps + 1):
        start = time.perf_counter()
        tokens = markov_batch(step, args.batch_size, args.seq_len, 64, args.seed).chunk(world)[rank]
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
        norm = clip_grad_norm_(optim, args.clip)
        optim.step()
        optim.zero_grad()
        mean_loss = loss.detach().clone()
        if dist.is_initialized():
            dist.all_reduce(mean_loss)
            mean_loss /= world
        if rank == 0:
            tok_s = args.batch_size * args.seq_len / (time.perf_counter() - start)
            print(f"step {step:4d}  loss {mean_loss.item():.4f}  grad-norm {norm.item():.3f}  {tok_s:,.0f} tok/s", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
