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

from mfsdp_core.buffer import FlatParamBuffer
from mfsdp_core.fence import await_fences
from mfsdp_core.fully_shard import buffers_of
from mfsdp_core.layout import Layout, Policy
from mfsdp_core.optim import optimizer_param
from mfsdp_core.plan import BufferSpec
from mfsdp_core.strategy import Strategy

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
    spec: BufferSpec  # the plan of its flat buffer; this parameter is spec.shapes[index]
    index: int
    group_rank: int  # this rank's index in the optimizer layout (the group the state is sharded over)
    param: FlatShard  # compute weights: the owned range under ZeRO-3 (and for MX params: main cast), else the whole parameter
    main: FlatShard  # main params, owned range (frozen parameters: their compute weights)
    grad: FlatShard | None  # reduced grads, owned range (ZeRO-1 also keeps replicas of the rest)
    optim: dict[str, FlatShard] = field(default_factory=dict)  # optimizer state shaped like the parameter
    optim_extra: dict[str, Any] = field(default_factory=dict)  # other state, e.g. Adam's 'step'
    companions: dict[str, FlatShard] = field(default_factory=dict)  # owned range of each companion plane
    optim_param: torch.Tensor | None = None  # the parameter the optimizer steps for it (None: not in the optimizer)

    @property
    def layout(self) -> Layout:
        """The layout of the main params and optimizer state (under HFSDP: over the whole mesh)."""
        return self.spec.optim_layout

    @property
    def strategy(self) -> Strategy:
        return self.spec.strategy

    @property
    def policy(self) -> Policy:
        return self.spec.policy

    @property
    def group_size(self) -> int:
        """Ranks the main params / optimizer state are sharded over (1: no_shard)."""
        return self.layout.group_size

    @property
    def is_expert(self) -> bool:
        return self.spec.is_expert

    @property
    def owned(self) -> tuple[int, int]:
        """The flat range this rank is responsible for (main params and optimizer state)."""
        pc = self.layout.piece(self.index, self.group_rank)
        return pc.start, pc.end


def _param_shards(buf: FlatParamBuffer, optimizer: torch.optim.Optimizer | None) -> list[ParamShard]:
    out = []
    r = buf.optim_rank
    for i, name in enumerate(buf.names):
        pc = buf.local_piece(i)
        local = slice(pc.shard_offset, pc.shard_offset + pc.numel)
        numel = buf.layout.numels[i]
        if buf.own_compute_shard:  # the weights themselves live only in the compute shard
            cpc = buf.layout.piece(i, buf.shard_rank)  # under HFSDP: more than the owned range
            param = FlatShard(cpc.start, cpc.end, buf.shard[cpc.shard_offset : cpc.shard_offset + cpc.numel])
        else:
            param = FlatShard(0, numel, buf.unsharded(i))
        main = FlatShard(pc.start, pc.end, buf.main[local])
        grad = FlatShard(pc.start, pc.end, buf.local_grad[local]) if buf.requires_grad else None
        optim: dict[str, FlatShard] = {}
        extra: dict[str, Any] = {}
        sp = optimizer_param(optimizer, buf, i) if optimizer is not None else None
        if sp is not None:
            for key, value in optimizer.state.get(sp, {}).items():
                if isinstance(value, torch.Tensor) and value.shape == sp.shape:
                    optim[key] = FlatShard(pc.start, pc.end, value if value.dim() == 1 else value.view(-1))
                else:
                    extra[key] = value
        companions = {name_: FlatShard(*buf.companion_shard(i, name_)) for name_ in buf.companions}
        out.append(
            ParamShard(
                fqn=name,
                shape=buf.layout.shapes[i],
                dtype=buf.compute_dtype,
                main_dtype=buf.main_dtype,
                spec=buf.spec,
                index=i,
                group_rank=r,
                param=param,
                main=main,
                grad=grad,
                optim=optim,
                optim_extra=extra,
                companions=companions,
                optim_param=sp,
            )
        )
    return out


def describe_shards(module: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> list[ParamShard]:
    """This rank's shards of every parameter under ``module`` (a ``fully_shard``-ed root), with
    the optimizer's per-parameter state when ``optimizer`` (adapted by ``fully_shard_optimizer``)
    is given. Optimizer state shaped like the parameter the optimizer sees (1-D pieces, or whole
    matrices under ``tensor``) is reported flat, by the same range as the main params.

    The views may be written (a checkpoint load does): a background copy of the state still
    running (``mfsdp_core.fence``) is waited for first."""
    buffers = buffers_of(module)
    await_fences(buffers)
    return [ps for buf in buffers for ps in _param_shards(buf, optimizer)]


def refresh_compute_params(module: nn.Module, *, derive_companions: bool = True) -> None:
    """After writing main params in place (a checkpoint load), make the compute params follow.
    ``derive_companions=False`` keeps the companion planes as written into their owned ranges
    (e.g. MX planes loaded from a checkpoint) instead of deriving them from the main params."""
    for buf in buffers_of(module):
        buf.refresh_compute_params(derive_companions=derive_companions)
