"""Stock DCP key layouts ⇄ canonical keys, and the ``--key-map`` prefix rules.

A DCP checkpoint written without us names its entries as its writer's state dict did:

- FSDP2 + ``torch.distributed.checkpoint.state_dict.get_state_dict`` saved as
  ``{"model": msd, "optim": osd}``: ``model.<fqn>``, ``optim.state.<fqn>.<state>``, and
  ``optim.param_groups.<i>.<hp>`` (``<i>`` the group's index, ``…<i>.params`` its parameters by
  name), or with ``flatten_optimizer_state_dict`` ``optim.param_groups.<fqn>.<hp>`` (one entry per
  parameter and hyper-parameter);
- torchtitan's ``CheckpointManager``: the model's bare names, ``optimizer.state.<fqn>.<state>``,
  ``optimizer.param_groups.<fqn>.<hp>`` and the trainer's ``lr_scheduler.*``, ``train_state.*``,
  ``dataloader.*`` (:mod:`mfsdp_ckpt.format.titan`), recognised from the names;
- a plain ``dcp.save`` of a state dict: whatever its keys are (a bare model, e.g. torchtitan's
  model-only save: ``--key-map '=model.'``).

Ours (:mod:`mfsdp_ckpt.format.keys`) are ``model.<fqn>``, ``optim.<fqn>.<state>`` and one
``optim.param_groups`` object (a list of groups naming their parameters). This module maps the
first onto the second (for reading: ``reshard``, ``load``) and back (``convert --to dcp-fsdp2``).
It is pure: names and small objects in, names and small objects out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

from mfsdp_ckpt.errors import CheckpointError
from mfsdp_ckpt.format.keys import MAIN_PARAM, PARAM_GROUPS, model_key
from mfsdp_ckpt.format.titan import (
    TITAN_GROUPS,
    TITAN_LAYOUT,
    is_titan_layout,
    non_model_entries,
    titan_to_canonical,
)

__all__ = [
    "KeyRule",
    "hiding",
    "parse_key_map",
    "apply_key_map",
    "is_stock",
    "StockNames",
    "canonical_names",
    "stock_param_groups",
    "to_fsdp2_key",
    "fsdp2_param_group_entries",
    "missing_summary",
    "STOCK_STATE",
    "STOCK_GROUPS",
]

STOCK_STATE = "optim.state."  # get_state_dict's per-parameter optimizer state, under "optim"
STOCK_GROUPS = "optim.param_groups."  # get_state_dict's hyper-parameters, one entry per (group, hp)


@dataclass(frozen=True)
class KeyRule:
    """Rename the prefix ``old`` of a key to ``new`` (``old`` empty: add ``new``; ``new`` empty:
    strip ``old``). Written ``OLD=NEW`` on the command line. With ``hide``, the entry named
    exactly ``old`` is left out of the canonical names (:func:`hiding`)."""

    old: str
    new: str
    hide: bool = False

    def __str__(self) -> str:
        return f"{self.old}=(hidden)" if self.hide else f"{self.old}={self.new}"

    def matches(self, key: str) -> bool:
        return key == self.old if self.hide else key.startswith(self.old)


def hiding(keys: Iterable[str]) -> tuple[KeyRule, ...]:
    """Rules leaving the stored entries ``keys`` out of the canonical names: what a load does
    with entries another step consumes (:mod:`mfsdp_ckpt.sharded.hooked`: the entries a module's
    state-dict hook turns into a parameter). No command line spelling."""
    return tuple(KeyRule(key, "", hide=True) for key in keys)


def parse_key_map(specs: Iterable[str] | None) -> tuple[KeyRule, ...]:
    """``OLD=NEW`` strings to rules (``'=model.'`` adds ``model.``, ``'model.='`` strips it).
    A key takes the first rule whose ``OLD`` it starts with; a key no rule matches is kept."""
    rules = []
    for spec in specs or ():
        if isinstance(spec, KeyRule):
            rules.append(spec)
            continue
        if not isinstance(spec, str) or "=" not in spec:
            raise CheckpointError(
                f"--key-map {spec!r}: expected OLD=NEW (a prefix rename: '=model.' adds 'model.', 'model.=' strips it)"
            )
        old, new = spec.split("=", 1)
        if not old and not new:
            raise CheckpointError(f"--key-map {spec!r}: OLD and NEW are both empty")
        rules.append(KeyRule(old, new))
    return tuple(rules)


def apply_key_map(key: str, rules: Sequence[KeyRule]) -> str:
    """``key`` renamed by the first rule whose prefix it has (unchanged when none; a hidden
    entry keeps its name: :func:`canonical_names` leaves it out)."""
    for rule in rules:
        if rule.matches(key):
            return key if rule.hide else rule.new + key[len(rule.old) :]
    return key


def is_stock(manifest: dict[str, Any] | None) -> bool:
    """Whether entries are named in a stock layout (``get_state_dict``'s, torchtitan's): a
    checkpoint without ``mfsdp.json``, or one we wrote in such a layout (``convert --to
    dcp-fsdp2``, ``reshard --to torchtitan``: the manifest's ``key_layout`` says so)."""
    return manifest is None or manifest.get("key_layout") in ("dcp-fsdp2", TITAN_LAYOUT)


@dataclass
class StockNames:
    """A checkpoint's entries under canonical names: ``sources[canonical] = stored key`` for
    every entry read as it is stored, and the stored objects that together make the one
    ``optim.param_groups`` entry (``group_parts``; empty when there is none to assemble)."""

    sources: dict[str, str] = field(default_factory=dict)
    group_parts: list[str] = field(default_factory=list)
    layout: str | None = None  # "torchtitan" when its layout was recognised and mapped

    def keys(self) -> list[str]:
        return sorted([*self.sources, *([PARAM_GROUPS] if self.group_parts else [])])


def canonical_names(
    stored: Iterable[str] | Mapping[str, Any], rules: Sequence[KeyRule] = (), *, stock_layout: bool = True
) -> StockNames:
    """The canonical name of every stored key: first ``rules`` (the user's ``--key-map``), then,
    with ``stock_layout`` (a checkpoint without ``mfsdp.json``), the stock layout's mapping:
    torchtitan's when the names are its (:func:`~mfsdp_ckpt.format.titan.is_titan_layout`: bare
    names → ``model.*``, ``optimizer.state.<fqn>.<state>`` → ``optim.<fqn>.<state>``, the
    trainer's entries as they are), else ``get_state_dict``'s (``optim.state.<fqn>.<state>`` →
    ``optim.<fqn>.<state>``); either's per-group or per-parameter hyper-parameter entries are
    gathered into one ``optim.param_groups``. Refused in one line: a rule filing entries that
    are not model weights (the optimizer's, the trainer's, objects: ``stored`` given as the
    metadata's mapping tells those) as ``model.*`` (:func:`check_model_rules`), and two stored
    keys that would get one name, naming both."""
    renamed = [(key, apply_key_map(key, rules)) for key in sorted(stored) if not _hidden(key, rules)]
    _check_model_rules(renamed, rules, _objects(stored))
    titan = stock_layout and is_titan_layout({name for _, name in renamed})
    names = StockNames(layout=TITAN_LAYOUT if titan else None)
    for key, name in renamed:
        if stock_layout and name.startswith(TITAN_GROUPS if titan else STOCK_GROUPS):
            names.group_parts.append(key)
            continue
        if titan:
            name = titan_to_canonical(name)
        elif stock_layout and name.startswith(STOCK_STATE):
            name = "optim." + name[len(STOCK_STATE) :]
        if name in names.sources:
            raise CheckpointError(f"keys '{names.sources[name]}' and '{key}' both map to '{name}' (check --key-map)")
        names.sources[name] = key
    if names.group_parts and PARAM_GROUPS in names.sources:
        raise CheckpointError(
            f"both '{PARAM_GROUPS}' and '{names.group_parts[0]}' are present: two optimizer "
            "hyper-parameter layouts in one checkpoint"
        )
    return names


def _hidden(key: str, rules: Sequence[KeyRule]) -> bool:
    """Whether the first rule ``key`` matches hides it."""
    rule = next((r for r in rules if r.matches(key)), None)
    return rule is not None and rule.hide


def _objects(stored: Iterable[str] | Mapping[str, Any]) -> set[str]:
    """The stored keys that are objects, not tensors (none known when only names are given): DCP's
    metadata of an object (``BytesStorageMetadata``) has no chunks; a tensor's has (read by that
    attribute, so that this module stays free of torch)."""
    if not isinstance(stored, Mapping):
        return set()
    return {key for key, md in stored.items() if not hasattr(md, "chunks")}


def _check_model_rules(renamed: Sequence[tuple[str, str]], rules: Sequence[KeyRule], objects: set[str]) -> None:
    """Refuse, in one line naming the entries and the rules, key-map rules that file entries
    which are not model weights (``(stored key, renamed)`` pairs) as ``model.*``: e.g. ``=model.``
    on a whole torchtitan checkpoint would make its optimizer state and trainer state weights."""
    bad = non_model_entries(renamed, objects)
    if not bad:
        return
    used = {next(r for r in rules if r.matches(k)) for k in bad}
    culprits = ", ".join(f"'{r}'" for r in rules if r in used)
    heads: dict[str, int] = {}
    for key in bad:
        head = key.split(".", 1)[0] + ".*" if "." in key else key
        heads[head] = heads.get(head, 0) + 1
    kinds = ", ".join(f"{head} ({n})" for head, n in sorted(heads.items(), key=lambda kv: (-kv[1], kv[0])))
    titan = is_titan_layout({key for key, _ in renamed})
    hint = "; a torchtitan checkpoint is read without a key map" if titan else ""
    what = "entry that is not a model weight" if len(bad) == 1 else "entries that are not model weights"
    raise CheckpointError(f"--key-map {culprits} would file {len(bad)} {what} as model.*: {kinds}, e.g. {bad[0]}{hint}")


def stock_param_groups(
    parts: Sequence[str], read: Callable[[str], Any], rules: Sequence[KeyRule] = ()
) -> list[dict[str, Any]]:
    """The canonical ``optim.param_groups`` (a list of groups, each naming its parameters) from
    stock entries ``optim.param_groups.<i>.<hp>`` (``<i>.params`` the group's parameters) or
    ``optim.param_groups.<fqn>.<hp>`` (flattened: parameters with equal hyper-parameters form one
    group, in the order they come), or torchtitan's ``optimizer.param_groups.<fqn>.<hp>`` (flattened
    too). ``read`` returns a stored object; ``rules`` rename its keys."""
    values: dict[str, dict[str, Any]] = {}
    for key in parts:
        name = apply_key_map(key, rules)
        prefix = TITAN_GROUPS if name.startswith(TITAN_GROUPS) else STOCK_GROUPS
        rest = name[len(prefix) :]
        if "." not in rest:
            raise CheckpointError(f"key '{key}': expected {prefix}<group or parameter>.<hyper-parameter>")
        owner, hp = rest.rsplit(".", 1)
        values.setdefault(owner, {})[hp] = read(key)
    indexed = all(owner.isdigit() for owner in values) and all("params" in v for v in values.values())
    if indexed:
        groups = []
        for owner in sorted(values, key=int):
            group = dict(values[owner])
            if not isinstance(group["params"], list) or not all(isinstance(p, str) for p in group["params"]):
                raise CheckpointError(f"key '{STOCK_GROUPS}{owner}.params': expected a list of parameter names")
            group["params"] = list(group["params"])
            groups.append(group)
        return groups
    flat: list[dict[str, Any]] = []
    for fqn, hps in values.items():  # flattened: one entry per parameter
        same = next((g for g in flat if {k: v for k, v in g.items() if k != "params"} == hps), None)
        if same is None:
            flat.append({**hps, "params": [fqn]})
        else:
            same["params"].append(fqn)
    return flat


def to_fsdp2_key(key: str) -> str | None:
    """The key ``get_state_dict`` + ``{"model": …, "optim": …}`` uses for canonical ``key``, or None
    for what a stock model and optimizer have no place for (gradients, MX planes, RNG states,
    ``optim.param_groups``: see :func:`fsdp2_param_group_entries`). ``optim.<fqn>.main_param`` (the
    fp32 weights of a low-precision model) becomes ``model.<fqn>``: FSDP2 keeps the weights in
    their own dtype, so the fp32 values are the ones to give it."""
    head = key.split(".", 1)[0]
    if key == PARAM_GROUPS or head in ("grad", "mx") or key.startswith("extra.rng."):
        return None
    if head == "optim":
        fqn, state = key[len("optim.") :].rsplit(".", 1)
        return model_key(fqn) if state == MAIN_PARAM else f"{STOCK_STATE}{fqn}.{state}"
    return key


def fsdp2_param_group_entries(groups: Any, source: str) -> dict[str, Any]:
    """``optim.param_groups.<i>.<hp>`` entries (``<i>.params``: the parameters by name) from the
    canonical groups, as ``get_state_dict`` lays them out."""
    if not isinstance(groups, list) or not all(
        isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups
    ):
        raise CheckpointError(f"{source}: key '{PARAM_GROUPS}': not a list of parameter groups naming their parameters")
    return {f"{STOCK_GROUPS}{i}.{hp}": value for i, group in enumerate(groups) for hp, value in group.items()}


def missing_summary(keys: Iterable[str]) -> str:
    """Keys a load did not find, in groups: ``model`` weights, each optimizer state by name
    (``optim.*.exp_avg``), ``optim.param_groups``, anything else by its first component; each
    with its count and first key, e.g. ``optim.*.exp_avg: 17 keys (optim.fc1.bias.exp_avg, …)``."""
    groups: dict[str, list[str]] = {}
    for key in sorted(keys):
        head = key.split(".", 1)[0]
        if key == PARAM_GROUPS:
            label = key
        elif head == "optim":
            label = "optim.*." + key.rsplit(".", 1)[-1]
        else:
            label = head + ".*"
        groups.setdefault(label, []).append(key)
    return "; ".join(
        f"{label}: {len(ks)} key{'s' if len(ks) > 1 else ''} ({ks[0]}{', …' if len(ks) > 1 else ''})"
        for label, ks in groups.items()
    )


def uncommitted_reason(directory: str, metadata: Any) -> str | None:
    """Why a checkpoint without ``mfsdp.json`` is an ``mfsdp_ckpt`` save that never committed (or
    lost its manifest) rather than a stock DCP checkpoint; None when nothing says so. The marks:
    a ``.partial-`` directory name; the per-rank RNG states every save of ours stores; DCP's
    record (``storage_meta``) of a ``.partial-`` directory, where a local save writes. On an
    object store a save writes in place and commits with the manifest, so only the RNG keys tell."""
    from mfsdp_ckpt.format.keys import RNG_PREFIX
    from mfsdp_ckpt.storage.staging import is_partial_name

    if is_partial_name(directory.rstrip("/").rsplit("/", 1)[-1]):
        return "a .partial directory"
    if any(key.startswith(RNG_PREFIX) for key in metadata.state_dict_metadata):
        return f"it holds '{RNG_PREFIX}*' keys, which mfsdp_ckpt writes"
    written_in = str(getattr(getattr(metadata, "storage_meta", None), "checkpoint_id", "") or "")
    if is_partial_name(written_in.rstrip("/").rsplit("/", 1)[-1]):
        return "DCP recorded it being written into an mfsdp_ckpt staging directory"
    return None
