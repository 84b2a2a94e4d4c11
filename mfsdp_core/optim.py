"""The optimizer adapter: any ``torch.optim`` optimizer steps on this rank's main-param shards.

``fully_shard_optimizer(optimizer)`` swaps every model parameter in ``optimizer.param_groups``
for a parameter viewing the part of the fp32 main params this rank owns (empty when it owns
none), whose ``.grad`` views the reduced gradients. The plan decides its shape: 1-D pieces for
flat policies, the whole shape where the policy keeps parameters whole (``tensor``), so that a
matrix optimizer sees matrices. Elementwise optimizers (AdamW, SGD with momentum, …) compute
exactly what they would on the full tensors; their state is per parameter, so it shards with the
parameter. After each step the main params are copied into the compute params (cast) and, for
ZeRO-1/2, all-gathered. The optimizer stays a real ``torch.optim.Optimizer``: LR schedulers and
``state_dict`` work as usual.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mfsdp_core import collectives as C
from mfsdp_core.buffer import FlatParamBuffer
from mfsdp_core.fence import await_fences
from mfsdp_core.fully_shard import owner_of

__all__ = ["fully_shard_optimizer", "clip_grad_norm_", "optimizer_buffers", "optimizer_param", "shard_of"]

_ADAPTED_ATTR = "_mfsdp_adapted"


class _Adapted:
    """What ``fully_shard_optimizer`` keeps on an optimizer: the buffers it steps on and, for each
    (buffer, parameter index), the parameter it steps for it."""

    def __init__(self) -> None:
        self.params: dict[FlatParamBuffer, dict[int, nn.Parameter]] = {}
        self.owners: dict[int, tuple[FlatParamBuffer, int]] = {}  # id(optimizer param) -> (buffer, index)

    @property
    def buffers(self) -> list[FlatParamBuffer]:
        return list(self.params)


def fully_shard_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Make ``optimizer`` step on the local fp32 shards. Call it once, before the first step.

    Frozen parameters (``requires_grad=False``, e.g. a router's expert bias) are left out of the
    groups: torch's optimizers skip them anyway, as they never get a gradient, so
    ``AdamW(model.parameters())`` works as it does on an unsharded model.

    Args:
        optimizer: built over a ``fully_shard``-ed model's parameters, without state yet.

    Returns:
        The same optimizer object, adapted."""
    if hasattr(optimizer, _ADAPTED_ATTR):
        raise ValueError("fully_shard_optimizer: this optimizer is already adapted")
    if optimizer.state:
        raise ValueError("fully_shard_optimizer: adapt the optimizer before its first step (it already has state)")
    adapted = _Adapted()
    for g, group in enumerate(optimizer.param_groups):
        shard_params = []
        for p in group["params"]:
            if not p.requires_grad:
                continue
            owner = owner_of(p)
            if owner is None:
                raise ValueError(
                    f"fully_shard_optimizer: param_groups[{g}] holds a parameter of shape {tuple(p.shape)} "
                    "that fully_shard does not manage (call fully_shard on the module that owns it)"
                )
            buf, i = owner
            mine = adapted.params.setdefault(buf, {})
            if i in mine:
                raise ValueError(f"fully_shard_optimizer: parameter '{buf.names[i]}' appears twice in param_groups")
            try:
                mine[i] = buf.make_optimizer_param(i)
            except ValueError as e:
                raise ValueError(f"fully_shard_optimizer: param_groups[{g}]: {e}") from None
            adapted.owners[id(mine[i])] = (buf, i)
            shard_params.append(mine[i])
        group["params"] = shard_params
    setattr(optimizer, _ADAPTED_ATTR, adapted)
    optimizer.register_step_pre_hook(_fence_before_step)
    optimizer.register_step_post_hook(_refresh_after_step)
    optimizer.zero_grad = _fenced_zero_grad(optimizer)
    return optimizer


def _fence_before_step(optimizer: torch.optim.Optimizer, _args: tuple, _kwargs: dict) -> None:
    """The step writes the main params and the optimizer state: wait for a background copy of
    them (``mfsdp_core.fence``)."""
    await_fences(optimizer_buffers(optimizer))


def _fenced_zero_grad(optimizer: torch.optim.Optimizer) -> Callable[..., None]:
    """``optimizer.zero_grad`` that, when it zeroes in place (``set_to_none=False``, which writes
    the reduced gradients), first waits for a background copy of the gradients. torch has no
    zero_grad hook; the wrapper refers to the optimizer weakly (no reference cycle: the buffers,
    and their process groups, must go with the last reference, see ``fully_shard``)."""
    ref = weakref.ref(optimizer)
    zero_grad = type(optimizer).zero_grad

    def fenced(set_to_none: bool = True) -> Any:
        opt = ref()
        if opt is None:
            return None
        if not set_to_none:
            await_fences(optimizer_buffers(opt), grads_only=True)
        return zero_grad(opt, set_to_none)

    fenced.__doc__ = zero_grad.__doc__
    return fenced


def _refresh_after_step(optimizer: torch.optim.Optimizer, _args: tuple, _kwargs: dict) -> None:
    for buf in optimizer_buffers(optimizer):
        buf.refresh_compute_params()


def _adapted(optimizer: torch.optim.Optimizer) -> _Adapted:
    adapted = getattr(optimizer, _ADAPTED_ATTR, None)
    if adapted is None:
        raise ValueError("this optimizer was not adapted with fully_shard_optimizer")
    return adapted


def optimizer_buffers(optimizer: torch.optim.Optimizer) -> list[FlatParamBuffer]:
    """The flat buffers whose shards ``optimizer`` steps on."""
    return _adapted(optimizer).buffers


def shard_of(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> tuple[FlatParamBuffer, int] | None:
    """The (buffer, index) whose shard ``param`` (one of ``optimizer``'s parameters) steps on, or
    None when the optimizer was not adapted: what a matrix optimizer needs to find the whole
    matrix behind a piece (its shape, every rank's piece, the shard group)."""
    adapted = getattr(optimizer, _ADAPTED_ATTR, None)
    return None if adapted is None else adapted.owners.get(id(param))


def optimizer_param(optimizer: torch.optim.Optimizer, buffer: FlatParamBuffer, index: int) -> nn.Parameter | None:
    """The parameter ``optimizer`` steps for parameter ``index`` of ``buffer`` (its key in
    ``optimizer.state``), or None when it does not hold that parameter."""
    return _adapted(optimizer).params.get(buffer, {}).get(index)


@torch.no_grad()
def clip_grad_norm_(
    optimizer: torch.optim.Optimizer, max_norm: float, *, error_if_nonfinite: bool = False
) -> torch.Tensor:
    """Scale the reduced gradients so that their global L2 norm is at most ``max_norm``; return
    the norm before scaling. Each element is counted once (replicated state on one replica only)
    and the squares are summed over the model's data-parallel group, the one the plan's buffers
    belong to: one all-reduce per distinct such group (normally one), never over ranks outside
    the model."""
    buffers = optimizer_buffers(optimizer)
    device = buffers[0].device if buffers else None
    partial: dict[int, tuple[dist.ProcessGroup | None, torch.Tensor]] = {}
    for buf in buffers:  # every rank visits every group, in the same order
        _, squares = partial.setdefault(
            id(buf.model_group), (buf.model_group, torch.zeros((), dtype=torch.float32, device=device))
        )
        if buf.counts_in_norm:
            squares += buf.local_grad.float().pow(2).sum()
    total = torch.zeros((), dtype=torch.float32, device=device)
    for group, squares in partial.values():
        C.all_reduce_sum(squares, group)
        total += squares
    total = total.sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    if error_if_nonfinite and not math.isfinite(total.item()):
        raise FloatingPointError(f"clip_grad_norm_: the total gradient norm is {total.item()}")
    await_fences(buffers, grads_only=True)
    for buf in buffers:
        buf.grad.mul_(coef.to(buf.grad.dtype))
    return total
