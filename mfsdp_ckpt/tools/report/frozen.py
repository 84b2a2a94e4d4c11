"""What trains and what is frozen in a checkpoint (``inspect --html``'s "LoRA fine-tune" section):
the LoRA adapters its model record names (rank, alpha, targets) and the tensors that hold them,
per target; the frozen weights it reads from its base (the sibling checkpoint that holds them,
written once: :mod:`mfsdp_ckpt.format.base_ref`), and how the reference to that base was checked;
trainable against frozen parameters.

Read from metadata only: the model record, the base reference in ``mfsdp.json``, and which data
files hold each entry (a base's files are named apart by the readers). Opening the checkpoint
already checked the reference (the base's save id, manifest checksum and content id); a
checkpoint whose reference does not hold never gets this far.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from mfsdp_ckpt.errors import ConversionError
from mfsdp_ckpt.format.base_ref import is_base, split_base_file
from mfsdp_ckpt.format.keys import PARAM_GROUPS
from mfsdp_ckpt.format.lora import LoraSpec, adapter_pairs, lora_of_record
from mfsdp_ckpt.tools.inspect import TensorInfo, compact_ranges
from mfsdp_ckpt.tools.report.kinds import layer_of, param_name
from mfsdp_ckpt.tools.report.layout import CheckpointLayout
from mfsdp_ckpt.tools.report.svg import esc, human_bytes

__all__ = ["AdapterTarget", "Frozen", "frozen_of", "frozen_section", "frozen_summary"]

_FACTOR = re.compile(r"^model\.(.+)\.lora_([AB])\.weight$")
#: what the page of a base says it is
_BASE_ROLE = (
    "a base: the frozen weights of a run, written once; the run's saves reference it and hold what trains "
    "(the adapters, their optimizer state)"
)


@dataclass
class AdapterTarget:
    """The adapters of one target (``q_proj``): the modules adapted, their layers, the shapes of
    their factors, and their tensors' count, elements and bytes."""

    target: str
    modules: set[str] = field(default_factory=set)
    layers: set[int] = field(default_factory=set)
    shapes: dict[str, set[str]] = field(default_factory=lambda: {"A": set(), "B": set()})
    tensors: int = 0
    params: int = 0
    bytes: int = 0


@dataclass
class Frozen:
    """The trainable / frozen split of a checkpoint's weights. ``spec``: the LoRA record (None:
    none, or it does not parse: ``problem``); ``check``: what checking the adapters against it
    found (None: sound); ``base``: the base's name and reference, ``from_base`` the keys read from
    it; ``trainable``: the weights that train (None: cannot tell), as ``told_by`` tells them;
    ``is_base``: the checkpoint is itself a base (the frozen weights of a run whose saves
    reference it)."""

    spec: LoraSpec | None = None
    problem: str | None = None
    check: str | None = None
    targets: list[AdapterTarget] = field(default_factory=list)
    adapters: list[TensorInfo] = field(default_factory=list)
    base: dict[str, Any] | None = None
    from_base: list[TensorInfo] = field(default_factory=list)
    weights: list[TensorInfo] = field(default_factory=list)
    trainable: set[str] | None = None
    told_by: str = ""
    is_base: bool = False

    @cached_property
    def base_keys(self) -> set[str]:
        """The keys read from the base."""
        return {t.key for t in self.from_base}

    @cached_property
    def adapter_keys(self) -> set[str]:
        """The keys of the LoRA factors."""
        return {t.key for t in self.adapters}

    @property
    def shown(self) -> bool:
        """Whether there is anything to say: LoRA adapters, a base, or being one."""
        return bool(self.spec or self.problem or self.adapters or self.base or self.is_base)

    @property
    def total(self) -> int:
        """Elements of every weight."""
        return sum(math.prod(t.shape or ()) for t in self.weights)

    def params(self, trainable: bool) -> tuple[int, int]:
        """(tensors, elements) of the trainable (or the frozen) weights."""
        ts = [t for t in self.weights if (t.key in (self.trainable or set())) == trainable]
        return len(ts), sum(math.prod(t.shape or ()) for t in ts)


def _lora(record: dict[str, Any] | None) -> tuple[LoraSpec | None, str | None]:
    """The LoRA spec a model record names (None: none), or why it does not parse."""
    try:
        return lora_of_record(record or {}, "model_source"), None
    except ValueError as e:
        return None, str(e)


def _target_of(module: str, spec: LoraSpec | None) -> str:
    """The target a module was adapted as: the first of ``spec.targets`` its name ends in (as
    PEFT matches them), else its last name."""
    for t in spec.targets if spec else ():
        if module == t or module.endswith("." + t):
            return t
    return module.rsplit(".", 1)[-1]


def _targets(adapters: list[TensorInfo], spec: LoraSpec | None) -> list[AdapterTarget]:
    """The adapter tensors grouped by target, in the order the spec names the targets."""
    out: dict[str, AdapterTarget] = {}
    for t in adapters:
        module, factor = _FACTOR.match(t.key).groups()  # type: ignore[union-attr]
        target = _target_of(module, spec)
        entry = out.setdefault(target, AdapterTarget(target))
        entry.modules.add(module)
        if (layer := layer_of(t.key)) is not None:
            entry.layers.add(layer)
        entry.shapes[factor].add("x".join(map(str, t.shape or ())))
        entry.tensors += 1
        entry.params += math.prod(t.shape or ())
        entry.bytes += t.bytes
    order = list(spec.targets) if spec else []
    return sorted(out.values(), key=lambda a: (order.index(a.target) if a.target in order else len(order), a.target))


def _check(weights: list[TensorInfo], spec: LoraSpec | None) -> str | None:
    """What the exports would refuse in these adapters (None: every factor has its partner and
    its base weight, and the shapes compose at the recorded rank)."""
    try:
        adapter_pairs({t.key: tuple(t.shape or ()) for t in weights}, spec, "the checkpoint")
    except ConversionError as e:
        return str(e)
    return None


def _trainable(layout: CheckpointLayout, weights: list[TensorInfo], base: set[str]) -> tuple[set[str] | None, str]:
    """The weights that train, and what tells them: those with optimizer state; without any state
    recorded, those not read from the base (None when neither tells)."""
    stated = {
        param_name(t.key)
        for t in layout.info.tensors
        if t.group == "optim" and t.key != PARAM_GROUPS and t.key.count(".") >= 2
    }
    if stated:
        return {t.key for t in weights if param_name(t.key) in stated}, "optimizer state"
    if base:
        return {t.key for t in weights if t.key not in base}, "the base"
    return None, ""


def frozen_of(layout: CheckpointLayout) -> Frozen:
    """The trainable / frozen split of the checkpoint ``layout`` describes."""
    info = layout.info
    spec, problem = _lora(info.model_source)
    weights = [t for t in info.tensors if t.group == "model" and t.shape is not None]
    in_base = {c.key for c in layout.chunks if split_base_file(c.file) is not None}
    adapters = [t for t in weights if _FACTOR.match(t.key)]
    out = Frozen(spec, problem, targets=_targets(adapters, spec), adapters=adapters, weights=weights)
    out.is_base = is_base(layout.manifest)
    if (spec or adapters) and not out.is_base:  # a base holds the frozen weights alone
        out.check = _check(weights, spec)
    if info.base is not None:
        reference = (layout.manifest or {}).get("base") or {}
        out.base = {**reference, **info.base}
    out.from_base = [t for t in info.tensors if t.key in in_base]
    if not out.is_base:
        out.trainable, out.told_by = _trainable(layout, weights, in_base)
    return out


def _count(tensors: int, params: int, total: int) -> str:
    """``896 parameters in 8 tensors (4.3%)``."""
    share = f" ({100 * params / total:.1f}%)" if total else ""
    return f"{params:,} parameters in {tensors} tensors{share}"


def frozen_summary(f: Frozen) -> list[tuple[str, str]]:
    """Rows for the page's summary table: ``LoRA`` and ``base``."""
    rows = []
    if f.spec is not None:
        trains = ""
        if f.trainable is not None:
            p = f.params(True)[1]
            trains = f"; {p:,} of {f.total:,} parameters train ({100 * p / (f.total or 1):.1f}%)"
        rows.append(("LoRA", f"fine-tune: r={f.spec.r}, alpha {f.spec.alpha:g} on {', '.join(f.spec.targets)}{trains}"))
    elif f.problem:
        rows.append(("LoRA", f.problem))
    if f.base is not None:
        rows.append(
            ("base", f"{f.base['name']}: {len(f.from_base)} frozen weights read from there (reference checked)")
        )
    if f.is_base:
        rows.append(("role", _BASE_ROLE))
    return rows


def frozen_section(f: Frozen) -> str:
    """The "LoRA fine-tune" (or "frozen weights") section: the facts, the adapters per target,
    and the two lists, folded: the adapter tensors and the entries read from the base."""
    if not f.shown:
        return ""
    title = "LoRA fine-tune" if f.spec or f.adapters or f.problem else "frozen weights"
    title = f"base of a {title}" if f.is_base and title == "LoRA fine-tune" else title
    facts = "".join(f'<tr title="{esc(tip)}"><th>{esc(k)}</th><td>{esc(v)}</td></tr>' for k, v, tip in _facts(f))
    return (
        f'<h2 id="lora">{esc(title)}</h2><div class="side"><table class="lora">{facts}</table>'
        f"{_targets_table(f)}</div>{_lists(f)}"
    )


def _facts(f: Frozen) -> list[tuple[str, str, str]]:
    """(label, value, tooltip) rows: the adapters, what trains and what is frozen, the base."""
    rows = [("role", _BASE_ROLE, "")] if f.is_base else []
    if f.spec is not None:
        s = f.spec
        rows.append(
            (
                "adapters",
                f"LoRA rank r={s.r}, alpha {s.alpha:g} (scale alpha / r = {s.scale:g}), dropout {s.dropout:g}",
                "",
            )
        )
        rows.append(("targets", ", ".join(s.targets), "PEFT's target_modules: every nn.Linear whose name ends in one"))
    elif f.problem:
        rows.append(("adapters", f.problem, ""))
    if f.adapters:
        modules = sum(len(a.modules) for a in f.targets)
        total = sum(t.bytes for t in f.adapters)
        rows.append(
            ("adapter tensors", f"{len(f.adapters)} (lora_A and lora_B of {modules} modules), {human_bytes(total)}", "")
        )
    if (f.spec or f.adapters) and not f.is_base:  # a check that passed implies a spec
        sound = f"every lora_A has its lora_B and its base weight; the shapes compose at r={f.spec.r}" if f.spec else ""
        rows.append(("checked", f.check or sound, "what export-hf (merged or --adapter) checks before it writes"))
    if f.trainable is not None:
        rows += _split(f)
    if f.base is not None:
        rows.append(_base_fact(f))
    return rows


def _split(f: Frozen) -> list[tuple[str, str, str]]:
    """The trainable and the frozen weights: how many, their share, and where they come from."""
    trains = _count(*f.params(True), f.total)
    if f.adapters and f.trainable == f.adapter_keys:
        trains += ": the adapters"
    frozen = _count(*f.params(False), f.total)
    frozen_keys = {t.key for t in f.weights} - (f.trainable or set())
    if f.base is not None and frozen_keys and frozen_keys <= f.base_keys:
        frozen += f", {human_bytes(sum(t.bytes for t in f.from_base))}: all read from {f.base.get('name')}"
    if f.told_by == "optimizer state":
        tips = ("the weights with optimizer state", "the weights without optimizer state")
    else:
        tips = ("the weights this checkpoint holds itself", "the weights read from the base")
    return [("trainable", trains, tips[0]), ("frozen", frozen, tips[1])]


def _base_fact(f: Frozen) -> tuple[str, str, str]:
    """The base: its name, what the page read from it, and how its reference was checked."""
    b = f.base or {}
    pins = [
        f"save id {b['save_id']}" if b.get("save_id") else "",
        f"manifest crc32c {b['manifest_crc32c']}" if b.get("manifest_crc32c") is not None else "",
        f"content id {b['id']}" if b.get("id") else "",
    ]
    text = (
        f"{b.get('name')}: a sibling checkpoint written once with the frozen weights; {len(f.from_base)} entries "
        "read from it. Reference checked: its save id, manifest crc32c and content id match (verify also reads its data)"
    )
    return "base", text, "; ".join(p for p in pins if p)


def _targets_table(f: Frozen) -> str:
    """A row per target (modules, layers, factor shapes, tensors, parameters, bytes) and one for all."""
    if not f.targets:
        return ""
    rows = "".join(
        f'<tr data-target="{esc(a.target)}"><td><code>{esc(a.target)}</code></td><td class=num>{len(a.modules)}</td>'
        f"<td>{esc(compact_ranges(sorted(a.layers)) if a.layers else '-')}</td>"
        f"<td>{esc(', '.join(sorted(a.shapes['A'])))}</td><td>{esc(', '.join(sorted(a.shapes['B'])))}</td>"
        f"<td class=num>{a.tensors}</td><td class=num>{a.params:,}</td><td class=num>{esc(human_bytes(a.bytes))}</td></tr>"
        for a in f.targets
    )
    total = (
        f'<tr class="total"><td>all</td><td class=num>{sum(len(a.modules) for a in f.targets)}</td><td></td><td></td>'
        f"<td></td><td class=num>{sum(a.tensors for a in f.targets)}</td>"
        f"<td class=num>{sum(a.params for a in f.targets):,}</td>"
        f"<td class=num>{esc(human_bytes(sum(a.bytes for a in f.targets)))}</td></tr>"
    )
    head = (
        "<tr><th>target</th><th class=num>modules</th><th>layers</th><th>lora_A</th><th>lora_B</th>"
        "<th class=num>tensors</th><th class=num>parameters</th><th class=num>bytes</th></tr>"
    )
    return f'<table class="adapters">{head}{rows}{total}</table>'


def _lists(f: Frozen) -> str:
    """The adapter tensors and the entries read from the base, each a folded list."""
    out = []
    if f.adapters:
        out.append(_folded("adapters", f"the {len(f.adapters)} adapter tensors", f.adapters))
    if f.from_base:
        name = (f.base or {}).get("name", "the base")
        out.append(_folded("from-base", f"the {len(f.from_base)} frozen weights read from {name}", f.from_base))
    return "".join(out)


def _folded(kind: str, title: str, tensors: list[TensorInfo]) -> str:
    """A list of tensors (key, shape, bytes) folded under ``title`` (``data-list``: ``kind``)."""
    rows = "".join(
        f'<tr data-key="{esc(t.key)}"><td class=key>{esc(t.key)}</td>'
        f"<td>{esc('x'.join(map(str, t.shape)) if t.shape else 'object')}</td>"
        f"<td class=num>{esc(human_bytes(t.bytes))}</td></tr>"
        for t in tensors
    )
    return (
        f'<details class="raw-config" data-list="{kind}"><summary>{esc(title)}</summary>'
        f"<table><tr><th>key</th><th>shape</th><th class=num>bytes</th></tr>{rows}</table></details>"
    )
