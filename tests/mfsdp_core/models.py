"""Small models and a single-process data-parallel reference for the runtime's tests.

Every 2-D weight has a multiple of 32 rows (so ``block(32)`` applies), while most parameter
sizes do not divide 2, 3 or 4, and each model has a one-element parameter."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from mfsdp_core import fully_shard

IN_FEATURES = 13
OUT_FEATURES = 32


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(IN_FEATURES)
        self.fc1 = nn.Linear(IN_FEATURES, 64)
        self.fc2 = nn.Linear(64, OUT_FEATURES)
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(self.norm(x)))) * self.scale


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.heads = heads
        self.attn_norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.mlp_norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.mlp_norm(x))))


class Transformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(IN_FEATURES, 32)
        self.block = Block(dim=32, heads=2, hidden=64)
        self.out = nn.Linear(32, OUT_FEATURES)
        self.gate = nn.Parameter(torch.full((1,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.block(self.inp(x))) * self.gate


MODELS: dict[str, Callable[[], nn.Module]] = {"mlp": MLP, "transformer": Transformer}


def make_model(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[name]()


def shard_model(model: nn.Module, **kwargs) -> nn.Module:
    """fully_shard the inner units first, then the root (as with FSDP2)."""
    inner = [model.fc1, model.fc2] if isinstance(model, MLP) else [model.block]
    for m in inner:
        fully_shard(m, **kwargs)
    return fully_shard(model, **kwargs)


def batch(step: int, world: int, per_rank: int = 3, seq: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step`` (same on every rank); rank r trains on chunk r."""
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(world * per_rank, seq, IN_FEATURES, generator=gen)
    y = torch.randn(world * per_rank, seq, OUT_FEATURES, generator=gen)
    return x, y


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(x).float(), y)


def make_adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=True)


def make_sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.01)


OPTIMIZERS: dict[str, Callable] = {"adamw": make_adamw, "sgd": make_sgd}


def reference_run(
    name: str, world: int, steps: int, micro_batches: int = 1, optimizer: str = "adamw"
) -> tuple[nn.Module, torch.optim.Optimizer, list[list[float]]]:
    """Data parallelism in one process: each rank's gradient computed separately, summed in
    rank order and divided by the world size (the runtime's deterministic reduction), then one
    optimizer step. Returns the model, its optimizer and per-step per-rank losses."""
    model = make_model(name)
    optim = OPTIMIZERS[optimizer](model.parameters())
    losses = []
    for step in range(steps):
        x, y = batch(step, world, per_rank=3 * micro_batches)
        accumulated = [torch.zeros_like(p) for p in model.parameters()]
        step_losses = []
        for mb in range(micro_batches):
            per_rank = []
            for r in range(world):
                xr, yr = x.chunk(world)[r].chunk(micro_batches)[mb], y.chunk(world)[r].chunk(micro_batches)[mb]
                model.zero_grad(set_to_none=True)
                loss = loss_fn(model, xr, yr) / micro_batches
                loss.backward()
                if mb == 0:
                    step_losses.append(loss.item())
                per_rank.append([p.grad.clone() for p in model.parameters()])
            for k, acc in enumerate(accumulated):
                total = per_rank[0][k].clone()
                for r in range(1, world):
                    total.add_(per_rank[r][k])
                acc.add_(total.div_(world))
        for p, g in zip(model.parameters(), accumulated):
            p.grad = g
        optim.step()
        losses.append(step_losses)
    return model, optim, losses


def set_data_parallel_grads(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    world: int,
    loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor] = loss_fn,
) -> None:
    """Each parameter's ``.grad`` := the sum in rank order of the per-rank gradients (rank r
    trains on chunk r of the global batch ``x, y``) divided by ``world``: the runtime's
    deterministic reduction, in one process."""
    grads = []
    for r in range(world):
        model.zero_grad()
        loss(model, x.chunk(world)[r], y.chunk(world)[r]).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for k, p in enumerate(model.parameters()):
        total = grads[0][k].clone()
        for r in range(1, world):
            total.add_(grads[r][k])
        p.grad = total.div_(world)


def train_steps(
    model: nn.Module, optim: torch.optim.Optimizer, start: int, stop: int, zero_grad_last: bool = True
) -> list[float]:
    """Sharded training, steps ``start .. stop-1``; rank r trains on chunk r of each global batch
    (the same whatever the world size)."""
    from mfsdp_core.collectives import rank_and_world

    rank, world = rank_and_world()  # (0, 1) in a process without a process group
    losses = []
    for step in range(start, stop):
        x, y = batch(step, world)
        loss = loss_fn(model, x.chunk(world)[rank], y.chunk(world)[rank])
        loss.backward()
        optim.step()
        if zero_grad_last or step < stop - 1:
            optim.zero_grad()
        losses.append(loss.item())
    return losses
