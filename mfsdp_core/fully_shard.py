"""``fully_shard``: per-module sharding with four strategies and four layout policies.

Like PyTorch's FSDP2, call it on each block first and then on the root. Each call makes the
parameters of that module which no inner call has taken into one *unit*; the unit packs them into
one flat buffer per (dtype, expert-ness, requires_grad) and shards it over the data-parallel group.

Hooks, per unit:
- forward pre-hook: gather the parameters (ZeRO-3); cast floating inputs to ``param_dtype``;
- forward hook: free the gathered parameters again (ZeRO-3) and hook the outputs so that the
  first gradient reaching them gathers the parameters for backward;
- per-parameter post-accumulate-grad hook: move the gradient into the buffer's staging area; when a
  buffer has all its gradients, reduce them (deterministically, see ``collectives``) and free the
  gathered parameters;
- an end-of-backward callback finishes any buffer that did not see all its gradients (unused
  parameters), in a fixed order, and resets the per-pass state.

All ranks must run the same units in forward and backward (as with DDP and FSDP).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from .buffer import FlatParamBuffer
from .collectives import group_size as _group_size
from .layout import Policy, compute_layout, parse_policy
from .mixed_precision import MixedPrecision
from .strategy import Strategy, parse_strategy

__all__ = ["fully_shard", "ShardedUnit", "units_of", "default_is_expert", "plan_buffers"]

_UNIT_ATTR = "_mfsdp_unit"
_OWNER_ATTR = "_mfsdp_owner"  # on a Parameter: (buffer, index)


def default_is_expert(name: str) -> bool:
    """Expert parameters (``…mlp.experts.linear_fc1.weight3``) go to their own buffer."""
    return "experts." in name


def _resolve_group(mesh: Any) -> dist.ProcessGroup | None:
    if mesh is None:
        return dist.group.WORLD if dist.is_initialized() else None
    if isinstance(mesh, dist.ProcessGroup):
        return mesh
    get_group = getattr(mesh, "get_group", None)
    if get_group is not None:
        if mesh.ndim != 1:
            raise ValueError(f"fully_shard: expected a 1-D device mesh, got {mesh.ndim}-D (HSDP is not built yet)")
        return get_group()
    raise ValueError(f"fully_shard: mesh must be a DeviceMesh, a ProcessGroup or None, got {type(mesh).__name__}")


class ShardedUnit:
    """The state ``fully_shard`` attaches to one module."""

    def __init__(
        self,
        module: nn.Module,
        buffers: list[FlatParamBuffer],
        *,
        strategy: Strategy,
        mixed_precision: MixedPrecision,
        reshard_after_forward: bool,
    ) -> None:
        self.module_ref = weakref.ref(module)
        self.buffers = buffers
        self.strategy = strategy
        self.mixed_precision = mixed_precision
        self.reshard_after_forward = reshard_after_forward
        self.used_in_forward = False  # since the last backward
        self.in_backward = False

    # ---- forward -------------------------------------------------------------------------
    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        for buf in self.buffers:
            buf.unshard()
        if torch.is_grad_enabled():
            self.used_in_forward = True
        dtype = self.mixed_precision.param_dtype
        if dtype is not None:
            cast = lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t  # noqa: E731
            args, kwargs = tree_map(cast, args), tree_map(cast, kwargs)
        return args, kwargs

    def post_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        if self.reshard_after_forward and not self.in_backward:
            for buf in self.buffers:
                buf.reshard()
        if torch.is_grad_enabled():
            tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            if tensors:
                torch.autograd.graph.register_multi_grad_hook(tensors, self._pre_backward, mode="any")
        return output

    # ---- backward ------------------------------------------------------------------------
    def _pre_backward(self, _grad: Any) -> None:
        _BackwardPass.ensure_callback()
        self.in_backward = True
        for buf in self.buffers:
            buf.unshard()

    def finish_pass(self) -> None:
        for buf in self.buffers:
            buf.finish_backward()
            buf.end_pass()
        self.used_in_forward = False
        self.in_backward = False


class _BackwardPass:
    """Finishes every unit used in forward once autograd's backward is done."""

    order: list["weakref.ref[ShardedUnit]"] = []
    queued = False

    @classmethod
    def register(cls, unit: ShardedUnit) -> None:
        cls.order.append(weakref.ref(unit))

    @classmethod
    def ensure_callback(cls) -> None:
        if not cls.queued:
            cls.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(cls.finish)

    @classmethod
    def finish(cls) -> None:
        cls.queued = False
        alive = [u for ref in cls.order if (u := ref()) is not None]
        cls.order = [weakref.ref(u) for u in alive]
        for unit in alive:  # creation order: the same on every rank
            if unit.used_in_forward or unit.in_backward:
                unit.finish_pass()


def _grad_hook(buffer: FlatParamBuffer, index: int) -> Callable[[torch.Tensor], None]:
    def hook(_param: torch.Tensor) -> None:
        buffer.on_grad_ready(index)

    return hook


def fully_shard(
    module: nn.Module,
    *,
    mesh: Any = None,
    strategy: str | Strategy = "optim_grads_params",
    policy: str | Policy = "even",
    mixed_precision: MixedPrecision | None = None,
    reshard_after_forward: bool = True,
    is_expert: Callable[[str], bool] = default_is_expert,
) -> nn.Module:
    """Shard ``module``'s parameters (those no inner ``fully_shard`` call took) over ``mesh``.

    ``mesh``: a 1-D DeviceMesh or ProcessGroup (default: the world group). ``strategy``:
    ``no_shard``, ``optim`` (ZeRO-1), ``optim_grads`` (ZeRO-2), ``optim_grads_params`` (ZeRO-3).
    ``policy``: ``even``, ``row``, ``block(n)`` or ``tensor`` (see :mod:`mfsdp_core.layout`).
    Every rank must hold the same initial weights. Returns ``module`` (sharded in place).
    """
    what = f"fully_shard({type(module).__name__})"
    if hasattr(module, _UNIT_ATTR):
        raise ValueError(f"{what}: fully_shard was already applied to this module")
    try:
        strat = parse_strategy(strategy)
        pol = parse_policy(policy)
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None
    mp = mixed_precision or MixedPrecision()
    group = _resolve_group(mesh)

    groups = _group_parameters(module, is_expert, lambda p: hasattr(p, _OWNER_ATTR))
    shard_ranks = _group_size(group) if strat.shards_optim else 1
    layouts = {}
    for key, (names, params) in groups.items():  # validate everything before changing anything
        try:
            layouts[key] = compute_layout([p.shape for p in params], shard_ranks, pol, names)
        except ValueError as e:
            raise ValueError(f"{what}: {e}") from None

    buffers = []
    for key, (names, params) in groups.items():
        buf = FlatParamBuffer(
            names, params, strategy=strat, layout=layouts[key], dp_group=group, mixed_precision=mp, is_expert=key[1]
        )
        for i, p in enumerate(params):
            setattr(p, _OWNER_ATTR, (buf, i))
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(_grad_hook(buf, i))
        buffers.append(buf)

    unit = ShardedUnit(
        module,
        buffers,
        strategy=strat,
        mixed_precision=mp,
        reshard_after_forward=reshard_after_forward and strat.shards_params,
    )
    setattr(module, _UNIT_ATTR, unit)
    module.register_forward_pre_hook(unit.pre_forward, with_kwargs=True)
    module.register_forward_hook(unit.post_forward, with_kwargs=True)
    _BackwardPass.register(unit)
    for prefix, sub in module.named_modules():
        sub_unit = getattr(sub, _UNIT_ATTR, None)
        if sub_unit is not None:
            for buf in sub_unit.buffers:
                buf.prefix = f"{prefix}." if prefix else ""
    return module


def _group_parameters(
    module: nn.Module, is_expert: Callable[[str], bool], taken: Callable[[nn.Parameter], bool]
) -> dict[tuple, tuple[list[str], list[nn.Parameter]]]:
    """``module``'s parameters that no inner unit took, by flat buffer: one per (dtype,
    expert-ness, requires_grad), in registration order."""
    groups: dict[tuple, tuple[list[str], list[nn.Parameter]]] = {}
    for name, p in module.named_parameters():
        if taken(p):
            continue
        key = (p.dtype, is_expert(name), p.requires_grad)
        names, params = groups.setdefault(key, ([], []))
        names.append(name)
        params.append(p)
    return groups


def plan_buffers(
    root: nn.Module, units: Sequence[nn.Module], is_expert: Callable[[str], bool] = default_is_expert
) -> list[tuple[list[str], bool]]:
    """The flat buffers that calling ``fully_shard(u)`` for each ``u`` of ``units`` (inner modules
    first, as those calls must be made) would create under ``root``: each buffer's parameter names
    relative to ``root``, in buffer order, and whether it holds experts; buffers in the order
    :func:`buffers_of` lists them. Touches no parameter and needs no process group, so it works on
    a meta-device model: what offline tools use to plan a layout without building the model."""
    prefix_of = {m: name for name, m in root.named_modules()}
    taken: set[int] = set()
    per_unit: dict[nn.Module, list[tuple[list[str], bool]]] = {}
    for unit in units:
        if unit not in prefix_of:
            raise ValueError(f"plan_buffers: {type(unit).__name__} is not a submodule of {type(root).__name__}")
        prefix = prefix_of[unit] + "." if prefix_of[unit] else ""
        groups = _group_parameters(unit, is_expert, lambda p: id(p) in taken)
        per_unit[unit] = [([prefix + n for n in names], key[1]) for key, (names, _) in groups.items()]
        taken.update(id(p) for _, params in groups.values() for p in params)
    return [buffer for m in root.modules() if m in per_unit for buffer in per_unit[m]]


def units_of(module: nn.Module) -> list[ShardedUnit]:
    """Every unit under ``module`` (itself included), in module order."""
    return [u for m in module.modules() if (u := getattr(m, _UNIT_ATTR, None)) is not None]


def buffers_of(module: nn.Module) -> list[FlatParamBuffer]:
    """Every flat buffer under ``module``."""
    return [b for u in units_of(module) for b in u.buffers]


def owner_of(param: nn.Parameter) -> tuple[FlatParamBuffer, int] | None:
    """The buffer holding ``param`` and its index there, or None if it is not sharded."""
    return getattr(param, _OWNER_ATTR, None)
