"""The schema of ``mfsdp.json``: the type and bounds of every field a reader of the manifest uses.

A manifest is JSON, so anything may be in it; every reader (``load``, ``verify``, ``inspect``,
``ls``, ``diff``, ``reshard``, the pruning of ``save(keep=…)``, the trainer's ``--resume``) goes
through :func:`check_manifest` first, and then relies on these types without checking again. A
violation is one :class:`~mfsdp_ckpt.errors.CorruptCheckpointError` naming the file and the field
(``writer.plan.buffers[0].shapes[1]``). Fields the schema does not list are allowed (newer writers
add some) and left alone; the manifest's checksum covers them too.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping

from mfsdp_ckpt.errors import CorruptCheckpointError
from mfsdp_ckpt.format.base_ref import BASE_ROLE, name_problem
from mfsdp_ckpt.format.lora import MAX_LORA_R, checked_spec, factor_problem
from mfsdp_ckpt.format.model_source import KINDS
from mfsdp_ckpt.format.names import member_name_problem, shown
from mfsdp_ckpt.format.record_table import table_size
from mfsdp_core.dtype_names import check_dtype_name
from mfsdp_core.expert_layout import EP_GROUP
from mfsdp_core.mx_names import ELEMENTS as MX_ELEMENTS
from mfsdp_core.mx_names import RULES as MX_RULES
from mfsdp_core.policy import parse_policy
from mfsdp_core.strategy import parse_strategy

__all__ = ["check_manifest", "key_problem", "MAX_DEPTH", "MAX_INT", "MAX_EP_SIZE", "MAX_EXPERT", "MAX_WORLD"]

MAX_DEPTH = 32  # nesting of JSON values: a manifest needs 6; deeper ones only exhaust the stack
MAX_INT = 2**63 - 1  # offsets, lengths, sizes: what a file or a tensor can hold

Check = Callable[[Any, str], None]  # raises _Invalid naming the field


class _Invalid(Exception):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(field, message)
        self.field, self.message = field, message


def _kind(value: Any) -> str:
    return {
        dict: "an object",
        list: "a list",
        str: "a string",
        bool: "a boolean",
        type(None): "null",
        int: "an integer",
        float: "a number",
    }.get(type(value), type(value).__name__)


def integer(lo: int = 0, hi: int = MAX_INT) -> Check:
    def check(v: Any, at: str) -> None:
        if type(v) is not int:
            raise _Invalid(at, f"expected an integer, got {_kind(v)}")
        if not lo <= v <= hi:
            raise _Invalid(at, f"{shown(v)} is outside [{lo}, {hi}]")

    return check


def number(v: Any, at: str) -> None:
    if type(v) not in (int, float) or not math.isfinite(v):
        raise _Invalid(at, f"expected a finite number, got {shown(v) if type(v) is float else _kind(v)}")


def string(v: Any, at: str) -> None:
    if type(v) is not str:
        raise _Invalid(at, f"expected a string, got {_kind(v)}")


def line(v: Any, at: str) -> None:
    """A string printed in one-line messages (a key, a name): no control characters."""
    string(v, at)
    if not v.isprintable():
        raise _Invalid(at, f"{shown(v)} holds control characters")


def key_problem(key: Any) -> str | None:
    """Why a reader refuses ``key`` as a key of the manifest (a checkpoint entry, a chunk id),
    None when it accepts it: the rule :func:`check_manifest` applies, for a writer to check its
    keys with before it writes anything."""
    try:
        line(key, "")
    except _Invalid as e:
        return e.message
    return None


def boolean(v: Any, at: str) -> None:
    if type(v) is not bool:
        raise _Invalid(at, f"expected true or false, got {_kind(v)}")


def anything(v: Any, at: str) -> None:
    pass


def nullable(check: Check) -> Check:
    def inner(v: Any, at: str) -> None:
        if v is not None:
            check(v, at)

    return inner


def parsed(parse: Callable[[str], Any], what: str) -> Check:
    """A string that ``parse`` accepts (a dtype name, a strategy, a policy)."""

    def check(v: Any, at: str) -> None:
        line(v, at)
        try:
            parse(v)
        except (ValueError, KeyError):
            raise _Invalid(at, f"{shown(v)} is not a known {what}") from None

    return check


def file_name(v: Any, at: str) -> None:
    problem = member_name_problem(v)
    if problem is not None:
        raise _Invalid(at, problem)


def list_of(item: Check) -> Check:
    def check(v: Any, at: str) -> None:
        if type(v) is not list:
            raise _Invalid(at, f"expected a list, got {_kind(v)}")
        for i, x in enumerate(v):
            item(x, f"{at}[{i}]")

    return check


def tuple_of(*items: Check) -> Check:
    """A list of exactly ``len(items)`` values, each checked by its own check."""

    def check(v: Any, at: str) -> None:
        if type(v) is not list or len(v) != len(items):
            raise _Invalid(
                at, f"expected a list of {len(items)} values, got {_kind(v) if type(v) is not list else len(v)}"
            )
        for i, (x, item) in enumerate(zip(v, items)):
            item(x, f"{at}[{i}]")

    return check


def dict_of(value: Check, key: Check = line) -> Check:
    def check(v: Any, at: str) -> None:
        if type(v) is not dict:
            raise _Invalid(at, f"expected an object, got {_kind(v)}")
        for k, x in v.items():
            key(k, f"{at} key {shown(k)}")
            value(x, f"{at}[{shown(k)}]" if at else shown(k))

    return check


def record(
    required: Mapping[str, Check] = {},
    optional: Mapping[str, Check] = {},  # read only
    then: Callable[[dict, str], None] | None = None,
) -> Check:
    """An object with these fields (others allowed and not checked); ``then`` checks relations
    between the fields once each is valid."""

    def check(v: Any, at: str) -> None:
        if type(v) is not dict:
            raise _Invalid(at or "(top level)", f"expected an object, got {_kind(v)}")
        for name, field_check in required.items():
            if name not in v:
                raise _Invalid(_join(at, name), "missing")
            field_check(v[name], _join(at, name))
        for name, field_check in optional.items():
            if name in v:
                field_check(v[name], _join(at, name))
        if then is not None:
            then(v, at)

    return check


def _join(at: str, name: str) -> str:
    return f"{at}.{name}" if at else name


def _same_length(a: str, b: str) -> Callable[[dict, str], None]:
    def then(v: dict, at: str) -> None:
        if len(v[a]) != len(v[b]):
            raise _Invalid(_join(at, b), f"{len(v[b])} entries for {len(v[a])} {a}")

    return then


_DTYPE = parsed(check_dtype_name, "dtype")
_STRATEGY = parsed(parse_strategy, "sharding strategy")
_POLICY = parsed(parse_policy, "sharding policy")
_COUNT = integer(1)


def _divisor(v: Any, at: str) -> None:
    """A gradient divisor: null, a count, or the name of a group (whose size it is)."""
    if v is None or isinstance(v, str):
        return None if v is None else line(v, at)
    return _COUNT(v, at)


_COMPANION = record(required={"name": line, "dtype": _DTYPE, "row_divisor": _COUNT, "col_divisor": _COUNT})


def _choice(*allowed: str) -> Check:
    def check(v: Any, at: str) -> None:
        line(v, at)
        if v not in allowed:
            raise _Invalid(at, f"{shown(v)} is not one of {', '.join(allowed)}")

    return check


def _lora_spec(v: dict, at: str) -> None:
    """The LoRA record as ``--lora`` would accept it: ``r`` within :data:`MAX_LORA_R`, targets
    module names (no ``../``, no dots), each once, a positive alpha, a dropout in [0, 1)."""
    try:
        checked_spec(v["r"], v["alpha"], v["targets"], v.get("dropout", 0.0), "")
    except ValueError as e:
        raise _Invalid(at, str(e).removeprefix(": ")) from None


_LORA = record(
    required={"r": integer(1, MAX_LORA_R), "alpha": number, "targets": list_of(line)},
    optional={"dropout": number},
    then=_lora_spec,
)
_MODEL_SOURCE = record(
    required={"kind": _choice(*KINDS)},
    optional={
        "class": line,
        "config": dict_of(anything),
        "args": dict_of(anything),
        "layer_spec": line,
        "lora": _LORA,
    },
)
_MX = record(required={"element": _choice(*MX_ELEMENTS), "rule": _choice(*MX_RULES)})
_BUFFER = record(
    required={
        "params": list_of(line),
        "shapes": list_of(list_of(integer())),
        "dtype": _DTYPE,
        "strategy": _STRATEGY,
        "policy": _POLICY,
        "group_size": _COUNT,
    },
    optional={
        "unit": nullable(line),
        "param_dtype": _DTYPE,
        "main_dtype": _DTYPE,
        "requires_grad": boolean,
        "group": line,
        "grad_divisor": _divisor,
        "divisor_size": _COUNT,
        "is_expert": boolean,
        "companions": list_of(_COMPANION),
        "mx": _MX,
        "first_rank": integer(),
        "replicate": line,  # HSDP / HFSDP: the group the buffer is replicated across
        "replicate_size": _COUNT,
        "shard_optim_across_replicas": boolean,
    },
    then=_same_length("params", "shapes"),
)


def _groups_named(v: dict, at: str) -> None:
    for i, b in enumerate(v["buffers"]):
        group = b.get("group", "dp")
        if group not in v["group_sizes"]:
            raise _Invalid(f"{_join(at, 'buffers')}[{i}].group", f"names group {shown(group)}, which group_sizes lacks")
        divisor = b.get("grad_divisor")
        if isinstance(divisor, str) and "divisor_size" not in b:
            raise _Invalid(
                f"{_join(at, 'buffers')}[{i}].divisor_size", f"missing: grad_divisor names group {shown(divisor)}"
            )


_PLAN = record(required={"group_sizes": dict_of(_COUNT), "buffers": list_of(_BUFFER)}, then=_groups_named)
_LEGACY_GROUP = record(
    required={"params": list_of(line), "strategy": _STRATEGY, "policy": _POLICY, "group_size": _COUNT},
    optional={"is_expert": boolean},
)
MAX_EP_SIZE = 1 << 16  # as many EP ranks as a job has ranks (reshard's --world-size bound)
MAX_EXPERT = 1 << 24  # a global expert index


def _experts_placed_once(v: dict, at: str) -> None:
    """One list of experts per EP rank, and no expert held by two EP ranks."""
    if len(v["owners"]) != v["ep_size"]:
        raise _Invalid(_join(at, "owners"), f"{len(v['owners'])} entries for EP size {v['ep_size']}")
    seen: set[int] = set()
    for p, experts in enumerate(v["owners"]):
        for e in experts:
            if e in seen:
                raise _Invalid(f"{_join(at, 'owners')}[{p}]", f"expert {e} is listed twice")
            seen.add(e)


_EXPERTS = record(
    required={"ep_size": integer(1, MAX_EP_SIZE), "owners": list_of(list_of(integer(0, MAX_EXPERT)))},
    then=_experts_placed_once,
)
_SUMMARY = record(required={"strategy": line, "policy": line, "group_size": _COUNT}, optional={"group": line})
_WRITER = record(
    optional={
        "world_size": _COUNT,
        "buffers": list_of(_SUMMARY),
        "plan": _PLAN,
        "groups": list_of(_LEGACY_GROUP),
        "experts": _EXPERTS,
    }
)


def _where(v: Any, at: str) -> None:
    """Where a key's chunks are: "o" (cut like the main params), "p" (an MX plane) or a rank."""
    if v in ("o", "p") and type(v) is str:
        return
    integer(0, MAX_INT)(v, at)


_INDEX = record(
    required={
        "version": integer(1, 1),
        "mesh": record(required={"world": _COUNT, "groups": dict_of(list_of(list_of(integer())))}),
        "ep_ranks": list_of(nullable(integer())),
        "keys": dict_of(tuple_of(nullable(_DTYPE), nullable(list_of(integer())), _where)),
        "files": list_of(tuple_of(file_name, integer(), integer(), integer(), integer(0, 2**32 - 1))),
    }
)
_CHUNK = record(required={"file": file_name, "offset": integer(), "length": integer(), "crc32c": integer(0, 2**32 - 1)})
_CRC = integer(0, 2**32 - 1)


MAX_WORLD = 1 << 20  # ranks of a job whose manifest has no index (an index proves its own: see _files_fit)


def _rank_of_job(rank: int, world: int, at: str) -> None:
    if rank >= world:
        raise _Invalid(at, f"rank {rank} is not a rank of the job ({world} ranks)")


def _files_fit(index: dict) -> int:
    """The job's world size, as the index's data files prove it: every rank of a save writes at
    least one data file, so ``mesh.world`` is the number of ranks the files name, and each
    file's record table fits in the file. Checked before anything of ``world`` entries is built."""
    world, ranks = index["mesh"]["world"], set()
    for i, (_, rank, size, rows, _) in enumerate(index["files"]):
        _rank_of_job(rank, world, f"index.files[{i}][1]")
        if table_size(rows) > size:
            raise _Invalid(f"index.files[{i}][3]", f"a record table of {rows} rows does not fit in {size} bytes")
        ranks.add(rank)
    if len(ranks) != world:
        raise _Invalid(
            "index.mesh.world", f"{world} ranks, but the index lists data files of {len(ranks)} (each rank writes one)"
        )
    return world


def _mesh_fits(index: dict, world: int) -> None:
    """Every rank the index names is one of the job's: group members, keys written whole, and
    EP ranks (which need the mesh's EP group, and fit in its instances)."""
    groups = index["mesh"]["groups"]
    for name, instances in groups.items():
        for i, ranks in enumerate(instances):
            for j, g in enumerate(ranks):
                _rank_of_job(g, world, f"index.mesh.groups[{shown(name)}][{i}][{j}]")
    for key, (_, _, where) in index["keys"].items():
        if type(where) is int:
            _rank_of_job(where, world, f"index.keys[{shown(key)}][2]")
    ep_size = max((len(r) for r in groups.get(EP_GROUP, ())), default=0)
    for i, ep_rank in enumerate(index["ep_ranks"]):
        if ep_rank is None:
            continue
        if EP_GROUP not in groups:
            raise _Invalid(f"index.ep_ranks[{i}]", f"EP rank {ep_rank}, but the mesh has no group '{EP_GROUP}'")
        if ep_rank >= ep_size:
            raise _Invalid(f"index.ep_ranks[{i}]", f"EP rank {ep_rank}, but the mesh's EP groups have {ep_size} ranks")


def _writer_fits(writer: dict, world: int | None) -> None:
    """The writer's group sizes within the job's world: the index's (proven by its data files),
    else the ``world_size`` it records (at most :data:`MAX_WORLD`). Layouts and placements are
    computed per rank of a group, so a size taken on trust is an allocation taken on trust."""
    recorded = writer.get("world_size")
    if world is not None and recorded is not None and recorded != world:
        raise _Invalid("writer.world_size", f"{recorded}, but the index's mesh has {world} ranks")
    if world is None:
        world = recorded if recorded is not None else MAX_WORLD
        if world > MAX_WORLD:
            raise _Invalid("writer.world_size", f"{world} is more than {MAX_WORLD} ranks")
    plan = writer.get("plan") or {}
    for name, size in plan.get("group_sizes", {}).items():
        if size > world:
            raise _Invalid(f"writer.plan.group_sizes[{shown(name)}]", f"{size} ranks in a job of {world}")
    for i, b in enumerate(plan.get("buffers", [])):
        if b["group_size"] * b.get("replicate_size", 1) > world:
            raise _Invalid(f"writer.plan.buffers[{i}].group_size", f"{b['group_size']} ranks in a job of {world}")
    for i, g in enumerate(writer.get("groups", [])):
        if g["group_size"] > world:
            raise _Invalid(f"writer.groups[{i}].group_size", f"{g['group_size']} ranks in a job of {world}")
    experts = writer.get("experts")
    if experts is not None and experts["ep_size"] > world:
        raise _Invalid("writer.experts.ep_size", f"{experts['ep_size']} EP ranks in a job of {world}")


def _sizes_fit(v: dict) -> None:
    """Sizes and ranks against what the checkpoint itself holds (the index's data files), before a
    reader allocates or builds anything from them."""
    world = None
    if "index" in v:
        world = _files_fit(v["index"])
        _mesh_fits(v["index"], world)
    if "writer" in v:
        _writer_fits(v["writer"], world)


def _chunks_or_index(v: dict, at: str) -> None:
    """A manifest lists every chunk (``chunks``: older saves, the offline tools) or holds an
    index of the save's layout, which needs the writer's plan; its sizes fit (:func:`_sizes_fit`);
    and its LoRA record says the adapters it holds (:func:`_lora_fits`)."""
    if "chunks" not in v and "index" not in v:
        raise _Invalid("chunks", "missing")
    if "index" in v and "plan" not in (v.get("writer") or {}):
        raise _Invalid("writer.plan", "missing: the index is derived from it")
    _sizes_fit(v)
    _lora_fits(v)


def _lora_fits(v: dict) -> None:
    """A save's ``model_source.lora`` against the LoRA factors its own entries hold (the index's
    keys with their shapes, or the chunk table's keys): the modules adapted are the record's
    targets, every target is adapted, every factor has its partner and the recorded rank
    (:func:`~mfsdp_ckpt.format.lora.factor_problem`). A base holds frozen weights only: not
    checked. Every reader (``verify``, the exports, ``--resume``) refuses a record that disagrees."""
    source = v.get("model_source")
    if v.get("role") == BASE_ROLE or not isinstance(source, dict) or source.get("lora") is None:
        return
    lora = source["lora"]
    spec = checked_spec(lora["r"], lora["alpha"], lora["targets"], lora.get("dropout", 0.0), "")
    if "index" in v:
        shapes = {k: shape for k, (_, shape, _) in v["index"]["keys"].items() if k.startswith("model.")}
    else:
        shapes = dict.fromkeys({cid.partition("@")[0] for cid in v["chunks"] if cid.startswith("model.")})
    problem = factor_problem(shapes, spec)
    if problem is not None:
        raise _Invalid("model_source.lora", problem)


def _base_name(v: Any, at: str) -> None:
    problem = name_problem(v)
    if problem is not None:
        raise _Invalid(at, problem)


_BASE = record(required={"name": _base_name, "id": line, "save_id": line, "manifest_crc32c": _CRC})

MANIFEST = record(
    required={"format": line},
    then=_chunks_or_index,
    optional={
        "chunks": dict_of(_CHUNK),
        "index": _INDEX,
        "format_version": integer(0),
        "manifest_crc32c": _CRC,
        "metadata_crc32c": _CRC,
        "save_id": nullable(line),
        "created_unix": number,
        "total_bytes": integer(),
        "step": nullable(integer()),
        "model_config": nullable(dict_of(anything)),
        "model_source": nullable(_MODEL_SOURCE),
        "run_config": dict_of(anything),
        "writer": _WRITER,
        "include_grads": boolean,
        "has_optimizer": boolean,
        "versions": dict_of(anything),
        "hf": record(optional={"architecture": nullable(line)}),
        "converted_from": nullable(string),
        "role": _choice(BASE_ROLE),
        "base": _BASE,
    },
)


def _too_deep(value: Any) -> str | None:
    """The path of a value nested deeper than :data:`MAX_DEPTH` (iteratively: no recursion)."""
    stack = [(value, "", 0)]
    while stack:
        v, at, depth = stack.pop()
        if depth > MAX_DEPTH:
            return (at[:120] + "...") if len(at) > 120 else at or "(top level)"
        if type(v) is dict:
            stack.extend((x, f"{at}[{shown(k, 40)}]" if at else shown(k, 40), depth + 1) for k, x in v.items())
        elif type(v) is list:
            stack.extend((x, f"{at}[{i}]", depth + 1) for i, x in enumerate(v))
    return None


def check_manifest(manifest: Any, source: str) -> None:
    """Raise one :class:`CorruptCheckpointError` (``<source>: field '<path>': <what>``) unless
    ``manifest`` (parsed JSON) has every field a reader uses with its type and bounds."""
    deep = _too_deep(manifest)
    if deep is not None:
        raise CorruptCheckpointError(f"{source}: field '{deep}': nested deeper than {MAX_DEPTH} levels")
    try:
        MANIFEST(manifest, "")
    except _Invalid as e:
        raise CorruptCheckpointError(f"{source}: field '{e.field}': {e.message}") from None
