"""The description of this rank's shards: the contract between the runtime and ``mfsdp_ckpt``.

For every parameter, :func:`describe_shards` says its canonical name, global shape and dtype, and
which flat range ``[start, end)`` of its row-major flattening this rank holds of each kind of
state, with the local 1-D tensor holding it. The tensors are views of the runtime's storage:
reading them costs no copy, and writing them (a checkpoint load) changes the model; after
writing main params call :func:`refresh_compute_params` so that the compute copies follow.

Because a layout is a pure function of (shapes, group size, policy), ``layout.piece(index, r)``
gives any rank's range without communication. See docs/shard_description.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .buffer import FlatParamBuffer
from .fully_shard import buffers_of
from .layout import Layout, Policy
from .strategy import Strategy

__all__ = ["FlatShard", "ParamShard", "describe_shards", "refresh_compute_params"]


@dataclass(frozen=True)
class FlatShard:
    """Elements ``[start, end)`` of a parameter's row-major flattening, held in ``tensor``
    (1-D, ``end - start`` elements, possibly 0)."""

    start: int
    end: int
    tensor: torch.Tensor


@dataclass(frozen=True)
class ParamShard:
    """What this rank holds of one parameter."""

    fqn: str  # canonical name, relative to the outermost fully_shard-ed module
    shape: torch.Size  # global (logical) shape
    dtype: torch.dtype  # dtype the model computes with
    main_dtype: torch.dtype  # dtype of the optimizer's main params
    strategy: Strategy
    policy: Policy
    group_size: int  # ranks the main params / optimizer state are sharded over (1: no_shard)
    group_rank: int  # this rank's index in that group
    is_expert: bool
    param: FlatShard  # compute weights: the owned range under ZeRO-3, else the whole parameter
    main: FlatShard  # main params, owned range (frozen parameters: their compute weights)
    grad: FlatShard | None  # reduced grads, owned range (ZeRO-1 also keeps replicas of the rest)
    optim: dict[str, FlatShard] = field(default_factory=dict)  # per-element optimizer state
    optim_extra: dict[str, Any] = field(default_factory=dict)  # other state, e.g. Adam's 'step'
    layout: Layout | None = None  # the buffer's layout; this parameter is layout.shapes[index]
    index: int = 0
    optim_param: torch.Tensor | None = None  # the parameter the optimizer steps for it (None: not in the optimizer)

    @property
    def owned(self) -> tuple[int, int]:
        """The flat range this rank is responsible for (main params and optimizer state)."""
        pc = self.layout.piece(self.index, self.group_rank)
        return pc.start, pc.end


def _param_shards(buf: FlatParamBuffer, optimizer: torch.optim.Optimizer | None) -> list[ParamShard]:
    out = []
    r = buf.shard_rank
    for i, name in enumerate(buf.names):
        pc = buf.local_piece(i)
        local = slice(pc.shard_offset, pc.shard_offset + pc.numel)
        numel = buf.layout.numels[i]
        if buf.strategy.shards_params:
            param = FlatShard(pc.start, pc.end, buf.shard[local])
        else:
            param = FlatShard(0, numel, buf._unsharded_flat(i))
        main = FlatShard(pc.start, pc.end, buf.main[local])
        grad = FlatShard(pc.start, pc.end, buf.local_grad[local]) if buf.requires_grad else None
        optim: dict[str, FlatShard] = {}
        extra: dict[str, Any] = {}
        sp = buf.shard_params[i] if buf.shard_params is not None else None
        if optimizer is not None and sp is not None:
            for key, value in optimizer.state.get(sp, {}).items():
                if isinstance(value, torch.Tensor) and value.shape == sp.shape:
                    optim[key] = FlatShard(pc.start, pc.end, value)
                else:
                    extra[key] = value
        out.append(
            ParamShard(
                fqn=name,
                shape=buf.layout.shapes[i],
                dtype=buf.compute_dtype,
                main_dtype=buf.main_dtype,
                strategy=buf.strategy,
                policy=buf.layout.policy,
                group_size=buf.layout.group_size,
                group_rank=r,
                is_expert=buf.is_expert,
                param=param,
                main=main,
                grad=grad,
                optim=optim,
                optim_extra=extra,
                layout=buf.layout,
                index=i,
                optim_param=sp,
            )
        )
    return out


def describe_shards(module: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> list[ParamShard]:
    """This rank's shards of every parameter under ``module`` (a ``fully_shard``-ed root), with
    the optimizer's per-parameter state when ``optimizer`` (adapted by ``fully_shard_optimizer``)
    is given."""
    return [ps for buf in buffers_of(module) for ps in _param_shards(buf, optimizer)]


def refresh_compute_params(module: nn.Module) -> None:
    """After writing main params in place (a checkpoint load), make the compute params follow."""
    for buf in buffers_of(module):
        buf.refresh_compute_params()
