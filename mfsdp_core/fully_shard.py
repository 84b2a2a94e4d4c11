"""``fully_shard``: per-module sharding, placed parameter by parameter.

Like PyTorch's FSDP2, call it on each block first and then on the root. Each call makes the
parameters of that module which no inner call has taken into one *unit*; the unit's placement
plan (:mod:`mfsdp_core.plan`) packs them into flat buffers, each sharded over the process group
its placement names.

Hooks, per unit:
- forward pre-hook: gather the parameters (ZeRO-3), waiting for a prefetch already in flight,
  then issue the all-gather of the unit expected to run next (see *Overlap*); cast floating
  inputs to ``param_dtype``;
- forward hook: free the gathered parameters again (ZeRO-3), except on the root and on a unit
  whose output hides its tensors from ``tree_flatten`` (a dataclass, a user class), which keep
  them for backward; hook the visible outputs so that the first gradient reaching them gathers
  the parameters for backward (and prefetches the next unit's);
- per-parameter post-accumulate-grad hook: move the gradient into the buffer's staging area; when a
  buffer has all its gradients, issue their reduction (deterministic, see ``collectives``) and
  free the gathered parameters;
- an end-of-backward callback finishes the reductions in flight, then any buffer that did not see
  all its gradients (unused parameters), in a fixed order, and resets the per-pass state.

Overlap. The root learns the order in which its units run forward, and the order in which their
backward starts, from the first pass, and learns it again whenever a pass runs them in another
order (a pass that leaves the learned order prefetches nothing from there on). With an order
known, each unit's pre-hook issues the next unit's all-gather before its own compute starts, so
the gather travels while this unit computes; with ``reshard_after_forward`` at most two units'
gathered parameters (besides the root's, which stay for backward) are alive at once. A buffer's
gradient reduction is issued when its last gradient arrives and finished (the rank-order sum,
the step across replicas, the accumulation) when the next reduction is issued or when backward
ends, so it travels while the earlier layers' backward computes. Every read waits for its
collective first. All ranks prefetch the same units in the same order, since all ranks run the
same units.

The backward bookkeeping lives in a context owned by the outermost sharded module (the root):
two models in one process share nothing. All ranks must run the same units in forward and
backward (as with DDP and FSDP).
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any, Callable, Mapping, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from mfsdp_core import collectives as C
from mfsdp_core.buffer import FlatParamBuffer
from mfsdp_core.comm_stream import CommStream
from mfsdp_core.layout import Policy
from mfsdp_core.mixed_precision import MixedPrecision
from mfsdp_core.plan import (
    DEFAULT_GROUP,
    DEFAULT_STRATEGY,
    ModelPlan,
    Placement,
    PlacementFn,
    add_owner_loads,
    placement_fn,
    plan_unit,
)
from mfsdp_core.pool import ScratchPool
from mfsdp_core.strategy import Strategy, parse_strategy
from mfsdp_core.torch_imports import import_dynamo_off_the_stack

__all__ = [
    "fully_shard",
    "rename_params",
    "set_overlap",
    "set_comm_stream",
    "ShardedUnit",
    "units_of",
    "buffers_of",
    "owner_of",
    "plan_of",
    "resolve_groups",
]

_UNIT_ATTR = "_mfsdp_unit"
# On a sharded Parameter, both weak since the buffer and the unit hold the parameter (see
# ``_on_grad_accumulated``): (a weak ref to its buffer, its index there); a weak ref to its unit.
_OWNER_ATTR = "_mfsdp_owner"
_GRAD_UNIT_ATTR = "_mfsdp_grad_unit"
_creation = itertools.count()  # units finish in creation order: the same on every rank

Groups = Mapping[str, Union[dist.ProcessGroup, None]]


def resolve_groups(mesh: Any) -> dict[str, dist.ProcessGroup | None]:
    """Named process groups from ``fully_shard``'s ``mesh``: None (the world), a ProcessGroup or a
    1-D DeviceMesh give ``{"dp": group}``; a DeviceMesh with named dimensions gives one group per
    dimension plus ``"dp"`` for the whole mesh (unless a dimension is called so); a dict maps names
    to groups and must name ``"dp"``, the model's data-parallel group."""
    if mesh is None:
        return {DEFAULT_GROUP: dist.group.WORLD if dist.is_initialized() else None}
    if isinstance(mesh, dist.ProcessGroup):
        return {DEFAULT_GROUP: mesh}
    if isinstance(mesh, Mapping):
        if DEFAULT_GROUP not in mesh:
            raise ValueError(
                f"mesh: a dict of named groups must name the model's data-parallel group '{DEFAULT_GROUP}'"
            )
        return dict(mesh)
    if hasattr(mesh, "get_group"):
        if mesh.ndim == 1:
            return {DEFAULT_GROUP: mesh.get_group()}
        names = mesh.mesh_dim_names
        if not names:
            raise ValueError(f"mesh: a {mesh.ndim}-D DeviceMesh needs mesh_dim_names (placements name the groups)")
        groups = {name: mesh.get_group(name) for name in names}
        if DEFAULT_GROUP not in groups:
            groups[DEFAULT_GROUP] = mesh._flatten(DEFAULT_GROUP).get_group()
        return groups
    raise ValueError(
        f"mesh must be a DeviceMesh, a ProcessGroup, a dict of named groups or None, got {type(mesh).__name__}"
    )


class _RootContext:
    """The backward bookkeeping of one root: its units, and whether the end-of-backward callback
    is queued for the backward pass now running.

    Every unit refers to its context, so the context refers to the units only weakly: a model must
    be freed as soon as its last user reference goes, by reference counting, not at some later
    garbage collection (its buffers hold the process groups; see ``_on_grad_accumulated``)."""

    def __init__(self, root: "ShardedUnit", units: list["ShardedUnit"]) -> None:
        self.root_ref = weakref.ref(root)
        self.unit_refs = [weakref.ref(u) for u in sorted(units, key=lambda u: u.seq)]
        self.queued = False
        self.orders = {FORWARD: _RunOrder(), BACKWARD: _RunOrder()}
        self.reductions: list[C.Pending] = []  # issued, in order; finished in that order
        self.pool = ScratchPool()  # the reductions' scratch tensors, shared by every buffer of the root
        self.overlap = True  # prefetch all-gathers and keep reductions in flight (set_overlap)
        self.comm: CommStream | None = None  # the stream collectives are issued from (set_comm_stream)
        for unit in units:
            for buf in unit.buffers:
                buf.pool = self.pool
                buf.comm = self.comm

    @property
    def units(self) -> list["ShardedUnit"]:
        """The live units of this root, in creation order."""
        return [u for ref in self.unit_refs if (u := ref()) is not None]

    def ensure_callback(self) -> None:
        if not self.queued:
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)

    def reduce(self, buf: FlatParamBuffer) -> None:
        """Issue ``buf``'s gradient reduction, then finish the ones issued before it: one
        reduction travels while backward computes on."""
        pending = buf.finish_backward(async_op=self.overlap)
        earlier, self.reductions = self.reductions, [pending] if pending is not None else []
        for p in earlier:
            p.wait()

    def finish_reductions(self) -> None:
        reductions, self.reductions = self.reductions, []
        for p in reductions:
            p.wait()

    def finish(self) -> None:
        self.queued = False
        self.finish_reductions()
        for unit in self.units:  # creation order: the same on every rank
            if unit.used_in_forward or unit.in_backward:
                unit.finish_pass()
            else:  # prefetched for a pass that did not run it
                for buf in unit.buffers:
                    if buf.gather_in_flight and unit.reshard_after_forward:
                        buf.reshard()
        self.pool.clear()  # memory between steps is what it would be without the pool
        self.orders[BACKWARD].end()

    def prefetch(self, unit: "ShardedUnit", direction: str) -> None:
        """Record that ``unit`` runs now in ``direction`` and issue the all-gather of the unit
        the learned order says comes next."""
        nxt = self.orders[direction].step(unit)
        if self.overlap and nxt is not None and nxt is not unit:
            for buf in nxt.buffers:
                buf.unshard(backward=direction == BACKWARD, async_op=True)


FORWARD, BACKWARD = "forward", "backward"


class _RunOrder:
    """The order in which a root's units run one direction of a pass, learned from the last pass
    that ran them in a new order; and where the pass now running stands in it."""

    def __init__(self) -> None:
        self.learned: list[weakref.ref[ShardedUnit]] = []
        self.seen: list[weakref.ref[ShardedUnit]] = []
        self.on_track = True  # the pass so far ran the learned order's prefix
        self.overflow = False  # the pass ran more units than can be recorded

    def begin(self) -> None:
        self.seen, self.on_track, self.overflow = [], True, False

    def step(self, unit: "ShardedUnit") -> "ShardedUnit | None":
        """Record ``unit``; the unit expected next, or None."""
        k = len(self.seen)
        if k > 4 * max(len(self.learned), 64):  # units run outside any root pass: stop recording
            self.overflow = True
            return None
        self.seen.append(weakref.ref(unit))
        self.on_track = self.on_track and k < len(self.learned) and self.learned[k]() is unit
        if self.on_track and k + 1 < len(self.learned):
            return self.learned[k + 1]()
        return None

    def end(self) -> None:
        """The pass is over: learn its order if it differs from the learned one."""
        same = len(self.seen) == len(self.learned) and all(a() is b() for a, b in zip(self.seen, self.learned))
        if not same and not self.overflow:
            self.learned = self.seen
        self.begin()


class ShardedUnit:
    """The state ``fully_shard`` attaches to one module."""

    def __init__(
        self,
        buffers: list[FlatParamBuffer],
        *,
        strategy: Strategy,
        groups: Groups,
        mixed_precision: MixedPrecision,
        reshard_after_forward: bool,
    ) -> None:
        self.buffers = buffers
        self.strategy = strategy
        self.groups = dict(groups)
        self.mixed_precision = mixed_precision
        self.reshard_after_forward = reshard_after_forward
        self.seq = next(_creation)
        self.context = _RootContext(self, [self])
        self.used_in_forward = False  # since the last backward
        self.in_backward = False

    @property
    def is_root(self) -> bool:
        return self.context.root_ref() is self

    # ---- forward -------------------------------------------------------------------------
    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        order = self.context.orders[FORWARD]
        if self.is_root:
            order.begin()
            if self.context.comm is not None:
                self.context.comm.mark_inputs()  # the last optimizer step's writes to the shards are queued
        for buf in self.buffers:
            buf.unshard()
        self.context.prefetch(self, FORWARD)
        if torch.is_grad_enabled():
            self.used_in_forward = True
        dtype = self.mixed_precision.param_dtype
        if dtype is not None:
            cast = lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t  # noqa: E731
            args, kwargs = tree_map(cast, args), tree_map(cast, kwargs)
        return args, kwargs

    def post_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        tensors = []
        if torch.is_grad_enabled():
            tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            if tensors:
                torch.autograd.graph.register_multi_grad_hook(tensors, self._pre_backward, mode="any")
        # a backward may follow: the root keeps its parameters for it (backward starts there), and
        # so does a unit whose output tensors no hook can see (nothing would gather them again)
        keep = torch.is_grad_enabled() and (self.is_root or not tensors)
        if self.reshard_after_forward and not self.in_backward and not keep:
            for buf in self.buffers:
                buf.reshard()
        if self.is_root:
            self.context.orders[FORWARD].end()
            if not torch.is_grad_enabled():  # no backward will clear it
                self.context.pool.clear()
        return output

    # ---- backward ------------------------------------------------------------------------
    def _pre_backward(self, _grad: Any) -> None:
        self.context.ensure_callback()
        self.in_backward = True
        for buf in self.buffers:
            buf.unshard(backward=True)
        self.context.prefetch(self, BACKWARD)

    def finish_pass(self) -> None:
        for buf in self.buffers:
            buf.finish_backward()
            buf.end_pass()
        self.used_in_forward = False
        self.in_backward = False


# the whole-tensor (``tensor`` policy) buffers of the model being sharded, so that each new unit's
# owners start at the least-loaded rank of its group: units of one parameter each spread over the
# ranks instead of all landing on rank 0 (emptied when the model's root is sharded; weak, so a
# model dropped half-way does not count)
_WHOLE_TENSOR_BUFFERS: "weakref.WeakSet[FlatParamBuffer]" = weakref.WeakSet()


def _whole_tensor_loads(groups: dict[str, Any]) -> dict[str, list[int]]:
    """Elements each rank of each of ``groups`` owns in the live whole-tensor buffers over it."""
    loads: dict[str, list[int]] = {}
    for buf in list(_WHOLE_TENSOR_BUFFERS):
        for name, group in groups.items():
            if buf.group is group:
                add_owner_loads(loads, buf.spec, name)
    return loads


def fully_shard(
    module: nn.Module,
    *,
    mesh: Any = None,
    strategy: str | Strategy = DEFAULT_STRATEGY,
    policy: str | Policy | None = None,
    placement: Union[Placement, PlacementFn, None] = None,
    mixed_precision: MixedPrecision | None = None,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """Shard ``module``'s parameters (those no inner ``fully_shard`` call took). Every rank must
    hold the same initial weights.

    Args:
        module: the module whose parameters to shard, in place.
        mesh: the process groups (see :func:`resolve_groups`; default: the world as ``"dp"``).
        strategy: ``no_shard``, ``optim`` (ZeRO-1), ``optim_grads`` (ZeRO-2) or
            ``optim_grads_params`` (ZeRO-3).
        policy: how ``"dp"`` cuts each parameter when ``placement`` is not given: ``even`` (the
            default), ``row``, ``block(n)``, ``tensor`` (see :mod:`mfsdp_core.layout`); experts go
            in buffers of their own.
        placement: a function ``fn(name, param) -> Placement`` (or one ``Placement`` for all)
            saying over which group, with which policy and gradient divisor each parameter is sharded.
        mixed_precision: the compute and reduction dtypes (default: ``MixedPrecision()``).
        reshard_after_forward: free the gathered parameters after forward (ZeRO-3 only).

    Returns:
        ``module``, sharded in place.
    """
    what = f"fully_shard({type(module).__name__})"
    if hasattr(module, _UNIT_ATTR):
        raise ValueError(f"{what}: fully_shard was already applied to this module")
    import_dynamo_off_the_stack()  # before the caller builds its optimizer (see mfsdp_core.torch_imports)
    try:
        strat = parse_strategy(strategy)
        fn = placement_fn(placement, policy)
        groups = resolve_groups(mesh)
        sizes = {name: C.group_size(g) for name, g in groups.items()}
        mp = mixed_precision or MixedPrecision()
        planned = plan_unit(
            module,
            placement=fn,
            group_sizes=sizes,
            strategy=strat,
            mixed_precision=mp,
            taken=lambda p: hasattr(p, _OWNER_ATTR),  # validates everything before changing anything
            owner_loads=_whole_tensor_loads(groups),
        )
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None

    buffers = [
        FlatParamBuffer(
            spec,
            params,
            group=groups[spec.placement.group],
            model_group=groups[DEFAULT_GROUP],
            replicate_group=groups[spec.placement.replicate] if spec.placement.replicate is not None else None,
        )
        for spec, params in planned
    ]
    _WHOLE_TENSOR_BUFFERS.update(buf for buf in buffers if buf.spec.policy.keeps_tensors_whole)
    unit = ShardedUnit(
        buffers,
        strategy=strat,
        groups=groups,
        mixed_precision=mp,
        reshard_after_forward=reshard_after_forward and strat.shards_params,
    )
    for buf in buffers:
        for i, p in enumerate(buf.params):
            setattr(p, _OWNER_ATTR, (weakref.ref(buf), i))
            if p.requires_grad:
                setattr(p, _GRAD_UNIT_ATTR, weakref.ref(unit))
                p.register_post_accumulate_grad_hook(_on_grad_accumulated)
    setattr(module, _UNIT_ATTR, unit)
    module.register_forward_pre_hook(unit.pre_forward, with_kwargs=True)
    module.register_forward_hook(unit.post_forward, with_kwargs=True)
    # this module is now the root of every unit under it: one context for all of them
    inner = units_of(module)
    context = _RootContext(unit, inner)
    for prefix, sub in module.named_modules():
        sub_unit = getattr(sub, _UNIT_ATTR, None)
        if sub_unit is not None:
            sub_unit.context = context
            for buf in sub_unit.buffers:
                buf.spec = buf.spec.with_prefix(f"{prefix}." if prefix else "")
    # the root of every whole-tensor buffer planned so far: that model is complete, and the next
    # model's units are balanced from zero (so two models built alike get the same plan)
    inner_units = [
        u for sub in module.modules() if sub is not module and (u := getattr(sub, _UNIT_ATTR, None)) is not None
    ]
    under = {id(buf) for u in (unit, *inner_units) for buf in u.buffers}
    if inner_units and all(id(buf) in under for buf in list(_WHOLE_TENSOR_BUFFERS)):
        _WHOLE_TENSOR_BUFFERS.clear()
    return module


def set_overlap(module: nn.Module, enabled: bool) -> nn.Module:
    """Turn the overlap of communication with compute on (the default) or off for the sharded
    ``module`` (the root, after its ``fully_shard``): off, each unit gathers its parameters when
    it runs and each reduction completes before backward goes on, as without prefetching. For
    comparing the two (``bench/step.py``) and for a run that cannot afford a second unit's
    gathered parameters. Results are bitwise the same either way. Returns ``module``."""
    unit = getattr(module, _UNIT_ATTR, None)
    if unit is None or not unit.is_root:
        raise ValueError(f"set_overlap: {type(module).__name__} is not the root of a fully_shard-ed model")
    unit.context.finish_reductions()
    unit.context.overlap = enabled
    return module


def set_comm_stream(module: nn.Module, enabled: bool, *, backend: Any = None) -> nn.Module:
    """Issue every all-gather and reduce-scatter of the sharded ``module`` (the root, after its
    ``fully_shard``) from one CUDA stream of its own instead of the compute stream (off by
    default; see :mod:`mfsdp_core.comm_stream`), so that a prefetch does not wait behind compute
    queued before it. Needs CUDA parameters: refused otherwise. ``backend``: the object making
    the stream calls (tests; default ``torch.cuda``). Returns ``module``."""
    unit = getattr(module, _UNIT_ATTR, None)
    if unit is None or not unit.is_root:
        raise ValueError(f"set_comm_stream: {type(module).__name__} is not the root of a fully_shard-ed model")
    context = unit.context
    buffers = [buf for u in context.units for buf in u.buffers]
    comm = None
    if enabled:
        devices = {buf.device for buf in buffers}
        if len(devices) != 1:
            raise ValueError(f"set_comm_stream: the model's parameters are on {len(devices)} devices; one is needed")
        try:
            comm = CommStream(devices.pop(), backend)
        except ValueError as e:
            raise ValueError(f"set_comm_stream: {e}") from None
    context.finish_reductions()
    for buf in buffers:
        buf.wait_unshard()  # nothing in flight crosses the switch
        buf.comm = comm
    context.comm = comm
    return module


def rename_params(module: nn.Module, fn: Callable[[str], str]) -> nn.Module:
    """Give every sharded parameter under ``module`` (the root, after its ``fully_shard``) the name
    ``fn(fqn)`` in the plan and the shard description, and so in checkpoints (``model.<name>``).

    For models whose module tree names a weight otherwise than its checkpoint does: Megatron-Core's
    local layer spec keeps ``input_layernorm.weight`` where its checkpoints (and ours) say
    ``self_attention.linear_qkv.layer_norm_weight``, and names experts by their local index. A name
    must stay inside its unit (keep the unit's path as prefix) and the names must stay distinct;
    ValueError naming the parameter otherwise. Module attributes are untouched. Returns ``module``."""
    buffers = buffers_of(module)
    renamed = [buf.spec.renamed(fn) for buf in buffers]
    seen: dict[str, str] = {}
    for old, new in zip((n for b in buffers for n in b.spec.fqns), (n for s in renamed for n in s.fqns)):
        if new in seen:
            raise ValueError(f"rename_params: '{old}' and '{seen[new]}' would both be named '{new}'")
        seen[new] = old
    for buf, spec in zip(buffers, renamed):
        buf.spec = spec
    return module


def _on_grad_accumulated(param: torch.Tensor) -> None:
    """A sharded parameter's post-accumulate-grad hook: queue the end-of-backward callback (also
    when no output hook fired, e.g. hidden outputs) and hand the gradient to its buffer.

    A plain function reaching the unit and buffer through weak references on the parameter:
    torch keeps tensor hooks in C++, out of the garbage collector's sight, so a hook holding them
    makes a cycle through the parameter that nothing breaks: the whole model stays alive until
    the interpreter exits, and with it the process groups its buffers hold (strong attributes
    would still leave it to a collection, which may come only during shutdown). A gloo group's
    worker threads stop only when its last reference goes; left running into interpreter
    shutdown, one that needs the GIL there (to release the tensors of a collective that just
    finished) is ended inside a C++ destructor, and the process dies with SIGABRT after its work
    is done. A model freed by reference counting lets ``destroy_process_group()`` stop them while
    the interpreter is alive.
    """
    owner, unit = owner_of(param), getattr(param, _GRAD_UNIT_ATTR)()
    if owner is None or unit is None:
        return  # its model is gone: nothing left to reduce into
    unit.context.ensure_callback()
    if owner[0].on_grad_ready(owner[1]):
        unit.context.reduce(owner[0])


def units_of(module: nn.Module) -> list[ShardedUnit]:
    """Every unit under ``module`` (itself included), in module order."""
    return [u for m in module.modules() if (u := getattr(m, _UNIT_ATTR, None)) is not None]


def buffers_of(module: nn.Module) -> list[FlatParamBuffer]:
    """Every flat buffer under ``module``, in module order."""
    return [b for u in units_of(module) for b in u.buffers]


def plan_of(module: nn.Module) -> ModelPlan:
    """The placement plan of a ``fully_shard``-ed ``module``: every buffer's spec (canonical
    names) and the sizes of the groups they name."""
    units = units_of(module)
    sizes = {name: C.group_size(g) for u in units for name, g in u.groups.items()}
    return ModelPlan(sizes, tuple(buf.spec for u in units for buf in u.buffers))


def owner_of(param: nn.Parameter) -> tuple[FlatParamBuffer, int] | None:
    """The buffer holding ``param`` and its index there, or None if it is not sharded (or its
    model is gone: the parameter refers to its buffer weakly, see ``_on_grad_accumulated``)."""
    owner = getattr(param, _OWNER_ATTR, None)
    if owner is None or (buf := owner[0]()) is None:
        return None
    return buf, owner[1]
