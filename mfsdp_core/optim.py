"""The optimizer adapter: any ``torch.optim`` optimizer steps on this rank's main-param shards.

``fully_shard_optimizer(optimizer)`` swaps every model parameter in ``optimizer.param_groups``
for a 1-D parameter viewing the part of the fp32 main params this rank owns (empty when it owns
none), whose ``.grad`` views the reduced gradients. Elementwise optimizers (AdamW, SGD with
momentum, …) compute exactly what they would on the full tensors; their state is per
parameter, so it shards with the parameter. After each step the main params are copied into the
compute params (cast) and, for ZeRO-1/2, all-gathered. The optimizer stays a real
``torch.optim.Optimizer``: LR schedulers and ``state_dict`` work as usual.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from . import collectives as C
from .buffer import FlatParamBuffer
from .fully_shard import owner_of

__all__ = ["fully_shard_optimizer", "clip_grad_norm_", "optimizer_buffers"]

_BUFFERS_ATTR = "_mfsdp_buffers"


def fully_shard_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Make ``optimizer`` (built over a ``fully_shard``-ed model's parameters) step on the local
    fp32 shards. Call it once, before the first step. Returns the same optimizer object."""
    if hasattr(optimizer, _BUFFERS_ATTR):
        raise ValueError("fully_shard_optimizer: this optimizer is already adapted")
    if optimizer.state:
        raise ValueError("fully_shard_optimizer: adapt the optimizer before its first step (it already has state)")
    buffers: list[FlatParamBuffer] = []
    for g, group in enumerate(optimizer.param_groups):
        shard_params = []
        for p in group["params"]:
            owner = owner_of(p)
            if owner is None:
                raise ValueError(
                    f"fully_shard_optimizer: param_groups[{g}] holds a parameter of shape {tuple(p.shape)} "
                    "that fully_shard does not manage (call fully_shard on the module that owns it)"
                )
            buf, i = owner
            if buf.shard_params is None:
                buf.shard_params = [None] * len(buf.params)
                buffers.append(buf)
            if buf.shard_params[i] is not None:
                raise ValueError(f"fully_shard_optimizer: parameter '{buf.names[i]}' appears twice in param_groups")
            pc = buf.local_piece(i)
            sp = nn.Parameter(buf.main[pc.shard_offset : pc.shard_offset + pc.numel], requires_grad=True)
            buf.shard_params[i] = sp
            shard_params.append(sp)
        group["params"] = shard_params
    for buf in buffers:
        buf.link_shard_grads()
    setattr(optimizer, _BUFFERS_ATTR, buffers)
    optimizer.register_step_post_hook(_refresh_after_step)
    return optimizer


def _refresh_after_step(optimizer: torch.optim.Optimizer, _args: tuple, _kwargs: dict) -> None:
    for buf in optimizer_buffers(optimizer):
        buf.refresh_compute_params()


def optimizer_buffers(optimizer: torch.optim.Optimizer) -> list[FlatParamBuffer]:
    """The flat buffers whose shards ``optimizer`` steps on."""
    buffers = getattr(optimizer, _BUFFERS_ATTR, None)
    if buffers is None:
        raise ValueError("this optimizer was not adapted with fully_shard_optimizer")
    return buffers


@torch.no_grad()
def clip_grad_norm_(
    optimizer: torch.optim.Optimizer, max_norm: float, *, error_if_nonfinite: bool = False
) -> torch.Tensor:
    """Scale the reduced gradients so that their global L2 norm is at most ``max_norm``; return
    the norm before scaling. The norm is summed over shards, each element counted once
    (replicated state is counted on one replica only), with one all-reduce over the world."""
    buffers = optimizer_buffers(optimizer)
    squares = torch.zeros((), dtype=torch.float32, device=buffers[0].device if buffers else None)
    for buf in buffers:
        replica = buf.shard_group is None and C.group_rank(buf.dp_group) != 0
        if not replica:
            squares += buf.local_grad.float().pow(2).sum()
    world = dist.group.WORLD if dist.is_initialized() else None
    C.all_reduce_sum(squares, world)
    total = squares.sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    if error_if_nonfinite and not math.isfinite(total.item()):
        raise FloatingPointError(f"clip_grad_norm_: the total gradient norm is {total.item()}")
    for buf in buffers:
        buf.grad.mul_(coef.to(buf.grad.dtype))
    return total
