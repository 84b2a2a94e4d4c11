"""The placement plan: how every parameter of a ``fully_shard``-ed model is stored and sharded.

A :class:`Placement` says, for one parameter, over which named process group its flat buffer is
sharded (``"dp"``: the model's data-parallel group, or any other group handed to ``fully_shard``),
with which layout policy, what its summed gradients are divided by, whether it is an expert, and
which :class:`Companion` planes are laid out from its rows and travel with it. A placement
function ``fn(name, param) -> Placement`` (in the style of FSDP2's ``shard_placement_fn``) gives
each parameter of a unit its placement; the parameters of one unit that share placement, dtype and
``requires_grad`` become one flat buffer, described by a :class:`BufferSpec`.

The plan is pure data, computed from (module, placement function, group sizes) without
communication. The runtime's buffers, the optimizer adapter, the shard description, the
checkpoint manifest and offline resharding all read it; none derives a layout another way.

A buffer sharded over a group smaller than ``"dp"`` holds, on each instance of that group, its own
parameters: gradients are reduced within the group only (the expert-parallel shape, where the
divisor is the data-parallel size, not the group's).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, Mapping, Sequence, Union

import torch
from torch import nn

from mfsdp_core.companion import Companion, as_matrix
from mfsdp_core.dtypes import dtype_by_name, dtype_name
from mfsdp_core.layout import Layout, Policy, compute_layout, parse_policy, refine_layout
from mfsdp_core.mixed_precision import MixedPrecision
from mfsdp_core.mx import MXFormat
from mfsdp_core.mx_planes import mx_companions
from mfsdp_core.strategy import Strategy, parse_strategy

__all__ = [
    "DEFAULT_GROUP",
    "DEFAULT_POLICY",
    "DEFAULT_STRATEGY",
    "Placement",
    "PlacementFn",
    "BufferSpec",
    "ModelPlan",
    "default_is_expert",
    "check_companions",
    "mx_marked",
    "mx_placement",
    "placement_fn",
    "plan_unit",
    "add_owner_loads",
    "plan_model",
]

DEFAULT_GROUP = "dp"
DEFAULT_STRATEGY = Strategy.OPTIM_GRADS_PARAMS
DEFAULT_POLICY = Policy("even")


def default_is_expert(name: str) -> bool:
    """Expert parameters (``…mlp.experts.linear_fc1.weight3``) go to buffers of their own."""
    return "experts." in name


@dataclass(frozen=True)
class Placement:
    """How one parameter is placed. ``group`` names a process group given to ``fully_shard``;
    ``grad_divisor`` divides the gradients summed over the group: a number, the name of a group
    (its size: an expert sharded over the expert-data-parallel group divides by ``"dp"``, since its
    summed gradient covers the tokens of every data-parallel rank), or None (``group``'s size).
    A group name keeps its meaning when the layout changes size.

    ``replicate`` (HSDP) names a group across which the buffer is *replicated*: each instance of
    ``group`` holds the same parameters, their gradients are reduced inside ``group`` and then
    across ``replicate``, and the default divisor is both groups' sizes. With
    ``shard_optim_across_replicas`` (HFSDP) the main params and optimizer state of each rank's
    shard are split again over ``replicate``, so they are sharded over the whole mesh while the
    compute params and gradients travel only inside ``group``."""

    policy: Policy = DEFAULT_POLICY
    group: str = DEFAULT_GROUP
    expert: bool = False
    grad_divisor: int | str | None = None
    companions: tuple[Companion, ...] = ()
    mx: MXFormat | None = None  # MXFP8: the parameter travels and computes as the MX planes (companions)
    replicate: str | None = None  # HSDP: the group the buffer is replicated across
    shard_optim_across_replicas: bool = False  # HFSDP: main params and optimizer state split over ``replicate`` too

    def __post_init__(self) -> None:
        if self.shard_optim_across_replicas and self.replicate is None:
            raise ValueError("shard_optim_across_replicas needs a replicate group")
        if self.replicate is not None and self.replicate == self.group:
            raise ValueError(f"replicate names the placement's own group '{self.group}'")
        object.__setattr__(self, "policy", parse_policy(self.policy))
        if self.mx is not None and not self.companions:
            object.__setattr__(self, "companions", mx_companions(self.mx))
        d = self.grad_divisor
        if isinstance(d, bool) or not (d is None or isinstance(d, str) or (isinstance(d, int) and d >= 1)):
            raise ValueError(f"grad_divisor must be >= 1 or a group name, got {d!r}")
        names = [c.name for c in self.companions]
        if len(set(names)) != len(names):
            raise ValueError(f"companion names must differ, got {names}")


PlacementFn = Callable[[str, nn.Parameter], Placement]


def mx_placement(fmt: MXFormat | None = None, policy: str | Policy = "block(32)", **kwargs: Any) -> Placement:
    """The placement of an MXFP8 weight: sharded on whole 32-row blocks (``policy`` must keep
    them whole), with its four MX planes as companions (:mod:`mfsdp_core.mx_planes`)."""
    return Placement(policy, mx=fmt or MXFormat(), **kwargs)


def mx_marked(place: PlacementFn, formats: Mapping[int, MXFormat]) -> PlacementFn:
    """``place``, except that the parameters in ``formats`` (keyed by ``id(param)``) become MXFP8
    in their format: ``block(32)`` with the MX planes, over the same group with the same divisor
    (what the trainer's ``--mxfp8`` and an MX ``import-hf`` plan)."""

    def fn(name: str, param: nn.Parameter) -> Placement:
        where = place(name, param)
        fmt = formats.get(id(param))
        return where if fmt is None else dataclasses.replace(where, policy="block(32)", mx=fmt, companions=())

    return fn


def placement_fn(placement: Union[Placement, PlacementFn, None], policy: str | Policy | None) -> PlacementFn:
    """The placement function ``fully_shard`` uses: ``placement`` itself, a fixed ``Placement``
    for every parameter, or the default (``policy``, group ``"dp"``, experts apart)."""
    if placement is not None and policy is not None:
        raise ValueError("pass either policy or placement, not both (a placement carries its policy)")
    if callable(placement) and not isinstance(placement, Placement):
        return placement
    if isinstance(placement, Placement):
        fixed = placement
        return lambda name, param: fixed
    pol = parse_policy(policy if policy is not None else DEFAULT_POLICY)
    return lambda name, param: Placement(pol, expert=default_is_expert(name))


@dataclass(frozen=True)
class BufferSpec:
    """One flat buffer: its parameters (names relative to ``prefix``, the unit's path under the
    outermost sharded module), their shapes and dtype, the strategy, the placement, and the size
    of the group it is sharded over. Everything else (layout, divisor, companion layouts, storage
    dtypes) follows from these."""

    names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    dtype: torch.dtype
    requires_grad: bool
    strategy: Strategy
    placement: Placement
    group_size: int  # ranks of placement.group (the buffer is sharded over them unless no_shard)
    prefix: str = ""
    divisor_size: int | None = None  # ranks of the group placement.grad_divisor names, if it names one
    param_dtype: torch.dtype | None = None  # compute dtype (mixed precision); None: ``dtype``
    main_dtype: torch.dtype = torch.float32
    # ``tensor`` policy: the rank the greedy owner assignment starts from. Chosen when planning as
    # the least-loaded rank of the group so far, so that one-parameter units spread over the ranks.
    first_rank: int = 0
    replicate_size: int = 1  # ranks of placement.replicate (HSDP / HFSDP); 1 without one

    def __post_init__(self) -> None:
        if self.param_dtype is None:
            object.__setattr__(self, "param_dtype", self.dtype)
        if isinstance(self.placement.grad_divisor, str) and self.divisor_size is None:
            raise ValueError(f"grad_divisor names group '{self.placement.grad_divisor}': its size is needed")

    # ---- derived -------------------------------------------------------------------------
    @property
    def fqns(self) -> list[str]:
        """Parameter names relative to the outermost sharded module (canonical names)."""
        return [self.prefix + n for n in self.names]

    @property
    def policy(self) -> Policy:
        return self.placement.policy

    @property
    def is_expert(self) -> bool:
        return self.placement.expert

    @property
    def shard_size_ranks(self) -> int:
        """Ranks the main params and optimizer state are split over (1 when nothing is sharded)."""
        return self.group_size if self.strategy.shards_optim else 1

    @property
    def grad_divisor(self) -> int:
        """What the gradients summed over the buffer's group are divided by."""
        d = self.placement.grad_divisor
        if d is None:
            return self.group_size * self.replicate_size
        return self.divisor_size if isinstance(d, str) else d

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.param_dtype

    @property
    def storage_main_dtype(self) -> torch.dtype:
        """Dtype of the main params: the optimizer's dtype when trained, else the weights'."""
        return self.main_dtype if self.requires_grad else self.compute_dtype

    @property
    def shaped_optimizer_state(self) -> bool:
        """True when every parameter lies whole on one rank, so the optimizer can see its shape
        (a matrix optimizer needs it); flat policies give it 1-D pieces."""
        return self.policy.keeps_tensors_whole

    @cached_property
    def layout(self) -> Layout:
        return compute_layout(self.shapes, self.shard_size_ranks, self.policy, self.fqns, self.first_rank)

    @property
    def shards_optim_across_replicas(self) -> bool:
        """HFSDP: the main params and optimizer state are split over the replicas as well."""
        return self.placement.shard_optim_across_replicas and self.replicate_size > 1

    @cached_property
    def optim_layout(self) -> Layout:
        """Who owns which range of the main params, optimizer state and reduced gradients:
        ``layout`` itself, except under HFSDP, where each shard-group rank's segment is split
        again over the replicas (rank ``shard_rank * replicate_size + replicate_rank``)."""
        if self.shards_optim_across_replicas:
            return refine_layout(self.layout, self.replicate_size)
        return self.layout

    @cached_property
    def companion_layouts(self) -> dict[str, Layout]:
        """Each companion plane's layout: rank r holds the plane rows of the parameter rows it owns."""
        return {c.name: _companion_layout(self.layout, c) for c in self.placement.companions}

    def owned_shape(self, index: int, rank: int) -> torch.Size:
        """Shape of rank ``rank``'s piece of parameter ``index`` as the optimizer sees it: 1-D for
        flat policies; the whole shape (or an empty one with the same trailing dims) when the
        policy keeps parameters whole."""
        piece = self.optim_layout.piece(index, rank)
        if not self.shaped_optimizer_state:
            return torch.Size((piece.numel,))
        shape = self.shapes[index]
        if piece.numel == math.prod(shape):
            return shape
        return torch.Size((0, *shape[1:])) if len(shape) else torch.Size((0,))

    # ---- changes -------------------------------------------------------------------------
    def with_prefix(self, prefix: str) -> "BufferSpec":
        """The same buffer under another unit path (its layouts carry over: names do not change them)."""
        out = dataclasses.replace(self, prefix=prefix)
        for key in ("layout", "optim_layout", "companion_layouts"):
            if key in self.__dict__:
                out.__dict__[key] = self.__dict__[key]
        return out

    def renamed(self, fn: Callable[[str], str]) -> "BufferSpec":
        """The same buffer with every parameter named ``fn(fqn)`` (its checkpoint name). The new
        name must keep the unit's path as its prefix: a parameter stays in its unit."""
        names = []
        for fqn in self.fqns:
            new = fn(fqn)
            if not isinstance(new, str) or not new.startswith(self.prefix) or len(new) == len(self.prefix):
                raise ValueError(f"rename of parameter '{fqn}' to {new!r} leaves its unit '{self.prefix[:-1]}'")
            names.append(new[len(self.prefix) :])
        out = dataclasses.replace(self, names=tuple(names))
        for key in ("layout", "optim_layout", "companion_layouts"):
            if key in self.__dict__:
                out.__dict__[key] = self.__dict__[key]
        return out

    def unreplicated(self, group: str = DEFAULT_GROUP) -> "BufferSpec":
        """The same buffer sharded flat over ``group``, the whole mesh (``group_size *
        replicate_size`` ranks), without replication: how offline tools lay out an HSDP / HFSDP
        buffer (its checkpoint does not depend on the mesh). Other buffers are returned as they are."""
        if self.placement.replicate is None:
            return self
        placement = dataclasses.replace(self.placement, group=group, replicate=None, shard_optim_across_replicas=False)
        return dataclasses.replace(
            self, placement=placement, group_size=self.group_size * self.replicate_size, replicate_size=1
        )

    def resized(
        self,
        group_size: int,
        *,
        strategy: Strategy | None = None,
        policy: Policy | None = None,
        group_sizes: Mapping[str, int] | None = None,
    ) -> "BufferSpec":
        """The same buffer in another layout: group size, and optionally strategy and policy;
        ``group_sizes`` gives the new size of the group a named divisor refers to."""
        placement = self.placement if policy is None else dataclasses.replace(self.placement, policy=policy)
        divisor_size = self.divisor_size
        if isinstance(placement.grad_divisor, str) and group_sizes is not None:
            divisor_size = group_sizes[placement.grad_divisor]
        return dataclasses.replace(
            self,
            group_size=group_size,
            strategy=strategy or self.strategy,
            placement=placement,
            divisor_size=divisor_size,
        )

    # ---- manifest ------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "unit": self.prefix[:-1],
            "params": self.fqns,
            "shapes": [list(s) for s in self.shapes],
            "dtype": dtype_name(self.dtype),
            "param_dtype": dtype_name(self.compute_dtype),
            "main_dtype": dtype_name(self.storage_main_dtype),
            "requires_grad": self.requires_grad,
            "strategy": self.strategy.value,
            "policy": str(self.policy),
            "group": self.placement.group,
            "group_size": self.group_size,
            "grad_divisor": self.placement.grad_divisor,  # null: the group's size; a name: that group's size
            **({"divisor_size": self.divisor_size} if self.divisor_size is not None else {}),
            "is_expert": self.is_expert,
            "companions": [c.to_dict() for c in self.placement.companions],
            **({"mx": self.placement.mx.to_dict()} if self.placement.mx is not None else {}),
            **({"first_rank": self.first_rank} if self.first_rank else {}),
            **(
                {
                    "replicate": self.placement.replicate,
                    "replicate_size": self.replicate_size,
                    "shard_optim_across_replicas": self.placement.shard_optim_across_replicas,
                }
                if self.placement.replicate is not None
                else {}
            ),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "BufferSpec":
        """Inverse of :meth:`to_dict`."""
        mx = MXFormat.from_dict(d["mx"]) if d.get("mx") is not None else None
        placement = Placement(
            parse_policy(d["policy"]),
            d.get("group", DEFAULT_GROUP),
            bool(d.get("is_expert", False)),
            d.get("grad_divisor"),
            () if mx is not None else tuple(Companion.from_dict(c) for c in d.get("companions", ())),
            mx,
            d.get("replicate"),
            bool(d.get("shard_optim_across_replicas", False)),
        )
        dtype = dtype_by_name(d["dtype"])
        prefix = f"{d['unit']}." if d.get("unit") else ""
        names = tuple(d["params"])
        if all(n.startswith(prefix) for n in names):
            names = tuple(n[len(prefix) :] for n in names)
        else:
            prefix = ""
        return cls(
            names=names,
            shapes=tuple(torch.Size(s) for s in d["shapes"]),
            dtype=dtype,
            prefix=prefix,
            requires_grad=bool(d.get("requires_grad", True)),
            strategy=parse_strategy(d["strategy"]),
            placement=placement,
            group_size=int(d["group_size"]),
            divisor_size=int(d["divisor_size"]) if d.get("divisor_size") is not None else None,
            param_dtype=dtype_by_name(d.get("param_dtype", d["dtype"])),
            main_dtype=dtype_by_name(d.get("main_dtype", "float32")),
            first_rank=int(d.get("first_rank", 0)),
            replicate_size=int(d.get("replicate_size", 1)),
        )


def _companion_layout(layout: Layout, comp: Companion) -> Layout:
    """The layout of ``comp``'s planes: packed in the parameters' order; each rank's boundary is
    moved from parameter rows to the plane rows covering them (ceil), so a rank holds exactly the
    plane rows of the rows it owns."""
    shapes = tuple(comp.shape(s) for s in layout.shapes)
    numels = [math.prod(s) for s in shapes]
    offsets, pos = [0] * len(shapes), 0
    for i in layout.order:
        offsets[i] = pos
        pos += numels[i]
    bounds = []
    for b in layout.bounds:
        at = next(
            (i for i in layout.order if layout.packed_offsets[i] <= b < layout.packed_offsets[i] + layout.numels[i]),
            None,
        )
        if at is None:  # at the end of the packed parameters
            bounds.append(pos)
            continue
        _, cols = as_matrix(layout.shapes[at])
        row = (b - layout.packed_offsets[at]) // cols
        bounds.append(offsets[at] + -(-row // comp.row_divisor) * shapes[at][1])
    shard = max((bounds[r + 1] - bounds[r] for r in range(layout.group_size)), default=0)
    return Layout(shapes, layout.group_size, layout.policy, layout.order, tuple(bounds), shard)


def check_companions(name: str, shape: torch.Size, placement: Placement) -> None:
    """A companion needs its parameter cut on whole blocks of ``row_divisor`` rows; an MXFP8
    parameter is a matrix whose both dims are multiples of 32."""
    if placement.mx is not None and (len(shape) != 2 or shape[0] % 32 or shape[1] % 32):
        raise ValueError(
            f"parameter '{name}' of shape {tuple(shape)}: MXFP8 needs a 2-D weight whose dims are "
            "both multiples of 32 (whole 32-element blocks in both orientations)"
        )
    numel = math.prod(shape)
    _, cols = as_matrix(shape)
    atom = placement.policy.atom(shape, name)
    if placement.mx is not None and numel and atom != numel and atom % (32 * cols):
        raise ValueError(
            f"parameter '{name}': policy {placement.policy} can split its 32-row blocks, which MXFP8 "
            "keeps whole on one rank (use block(32) or tensor)"
        )
    for comp in placement.companions:
        if numel and atom != numel and atom % (comp.row_divisor * cols):
            raise ValueError(
                f"parameter '{name}': policy {placement.policy} cuts it inside blocks of "
                f"{comp.row_divisor} rows, which companion '{comp.name}' needs whole"
            )


def plan_unit(
    module: nn.Module,
    *,
    placement: PlacementFn,
    group_sizes: Mapping[str, int],
    strategy: Strategy,
    mixed_precision: MixedPrecision,
    taken: Callable[[nn.Parameter], bool] = lambda p: False,
    prefix: str = "",
    owner_loads: dict[str, list[int]] | None = None,
) -> list[tuple[BufferSpec, list[nn.Parameter]]]:
    """The flat buffers ``fully_shard(module)`` makes of the parameters no inner unit took
    (``taken``): one per (placement, dtype, requires_grad), in registration order, each with its
    parameters. ``placement`` gets names relative to ``module``; ``prefix`` (the module's path)
    only names parameters in errors. Raises ValueError naming the parameter that cannot be placed.

    ``owner_loads``: elements each rank of a group already owns in whole-tensor (``tensor``)
    buffers planned before (group name -> one count per rank); each such buffer here starts its
    owner assignment at the least-loaded rank, and its elements are added (the dict is updated)."""
    loads = owner_loads if owner_loads is not None else {}
    grouped: dict[tuple, tuple[list[str], list[nn.Parameter]]] = {}
    for name, p in module.named_parameters():
        if taken(p):
            continue
        where = placement(name, p)
        if not isinstance(where, Placement):
            raise ValueError(
                f"placement function returned {type(where).__name__} for '{prefix}{name}', expected a Placement"
            )
        roles = (
            ("placement", where.group),
            ("placement's grad_divisor", where.grad_divisor),
            ("placement's replicate", where.replicate),
        )
        for role, group in roles:
            if isinstance(group, str) and group not in group_sizes:
                raise ValueError(
                    f"parameter '{prefix}{name}': {role} names group '{group}'; "
                    f"the groups given are {', '.join(sorted(group_sizes))}"
                )
        check_companions(prefix + name, p.shape, where)
        _check_replication(prefix + name, where, strategy)
        names, params = grouped.setdefault((where, p.dtype, p.requires_grad), ([], []))
        names.append(name)
        params.append(p)
    out = []
    for (where, dtype, requires_grad), (names, params) in grouped.items():
        spec = BufferSpec(
            names=tuple(names),
            shapes=tuple(p.shape for p in params),
            dtype=dtype,
            requires_grad=requires_grad,
            strategy=strategy,
            placement=where,
            group_size=group_sizes[where.group],
            divisor_size=group_sizes[where.grad_divisor] if isinstance(where.grad_divisor, str) else None,
            param_dtype=mixed_precision.param_dtype,
            main_dtype=mixed_precision.main_dtype,
            replicate_size=group_sizes[where.replicate] if where.replicate is not None else 1,
        )
        if spec.policy.keeps_tensors_whole and spec.shard_size_ranks > 1:
            spec = dataclasses.replace(spec, first_rank=_least_loaded(loads, where.group, spec.shard_size_ranks))
        spec.layout  # noqa: B018 - computed now, so a policy that cannot cut a parameter fails here
        add_owner_loads(loads, spec)
        out.append((spec, params))
    return out


def _check_replication(name: str, where: Placement, strategy: Strategy) -> None:
    """HFSDP splits the reduced gradients and main params of a shard again over the replicas:
    that needs the gradients sharded (ZeRO-2 / ZeRO-3), and companion planes (derived from the
    main params of whole rows) are not split that way."""
    if not where.shard_optim_across_replicas:
        return
    if not strategy.shards_grads:
        raise ValueError(
            f"parameter '{name}': HFSDP (optimizer state sharded across replicas) needs strategy "
            f"optim_grads or optim_grads_params, not {strategy.value}"
        )
    if where.companions:
        raise ValueError(f"parameter '{name}': HFSDP does not support companion planes (MXFP8); use HSDP")


def _least_loaded(loads: Mapping[str, Sequence[int]], group: str, n: int) -> int:
    counts = loads.get(group)
    if counts is None or len(counts) != n:
        return 0
    return min(range(n), key=lambda r: (counts[r], r))


def whole_tensor_owner_counts(spec: "BufferSpec") -> list[int] | None:
    """Elements each rank owns in ``spec`` when it is a sharded whole-tensor buffer; else None."""
    if not spec.policy.keeps_tensors_whole or spec.shard_size_ranks <= 1:
        return None
    bounds = spec.layout.bounds
    return [bounds[r + 1] - bounds[r] for r in range(spec.shard_size_ranks)]


def add_owner_loads(loads: dict[str, list[int]], spec: "BufferSpec", group: str | None = None) -> None:
    """Add the elements each rank owns in ``spec`` (a whole-tensor buffer; others are ignored)
    to ``loads`` (group name -> count per rank), under ``group`` (default: the spec's group)."""
    owned = whole_tensor_owner_counts(spec)
    if owned is None:
        return
    counts = loads.setdefault(group or spec.placement.group, [0] * len(owned))
    if len(counts) == len(owned):
        for r, n in enumerate(owned):
            counts[r] += n


@dataclass(frozen=True)
class ModelPlan:
    """Every flat buffer of a sharded model (canonical names), with the sizes of the groups the
    placements name. What the checkpoint manifest records and what offline resharding reads."""

    group_sizes: Mapping[str, int]
    buffers: tuple[BufferSpec, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"group_sizes": dict(self.group_sizes), "buffers": [b.to_dict() for b in self.buffers]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ModelPlan":
        return cls(dict(d["group_sizes"]), tuple(BufferSpec.from_dict(b) for b in d["buffers"]))

    def params(self) -> dict[str, tuple[BufferSpec, int]]:
        """Every parameter's buffer and index there."""
        return {name: (spec, i) for spec in self.buffers for i, name in enumerate(spec.fqns)}


def plan_model(
    root: nn.Module,
    units: Sequence[nn.Module],
    *,
    placement: Union[Placement, PlacementFn, None] = None,
    policy: str | Policy | None = None,
    strategy: str | Strategy = DEFAULT_STRATEGY,
    group_sizes: Mapping[str, int] | None = None,
    mixed_precision: MixedPrecision | None = None,
) -> ModelPlan:
    """The plan that calling ``fully_shard(u, ...)`` for each ``u`` of ``units`` (inner modules
    first, as those calls must be made) with these arguments would give ``root``. Touches no
    parameter and needs no process group, so it works on a meta-device model.
    ``group_sizes`` defaults to ``{"dp": 1}``."""
    fn = placement_fn(placement, policy)
    sizes = dict(group_sizes or {DEFAULT_GROUP: 1})
    strat = parse_strategy(strategy)
    mp = mixed_precision or MixedPrecision()
    prefix_of = {m: name for name, m in root.named_modules()}
    taken: set[int] = set()
    loads: dict[str, list[int]] = {}
    per_unit: dict[nn.Module, list[BufferSpec]] = {}
    for unit in units:
        if unit not in prefix_of:
            raise ValueError(f"plan_model: {type(unit).__name__} is not a submodule of {type(root).__name__}")
        prefix = prefix_of[unit] + "." if prefix_of[unit] else ""
        planned = plan_unit(
            unit,
            placement=fn,
            group_sizes=sizes,
            strategy=strat,
            mixed_precision=mp,
            taken=lambda p: id(p) in taken,
            prefix=prefix,
            owner_loads=loads,
        )
        per_unit[unit] = [spec.with_prefix(prefix) for spec, _ in planned]
        taken.update(id(p) for _, params in planned for p in params)
    return ModelPlan(sizes, tuple(spec for m in root.modules() if m in per_unit for spec in per_unit[m]))
