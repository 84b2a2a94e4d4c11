"""The top of the ``diff --html`` page: what changed, per kind of entry and per part of the state.

Two checkpoints of one run differ everywhere, but by amounts of very different sizes: a weight
moves by 1e-2, Adam's ``exp_avg_sq`` by 1e-8, and every ``step`` counter by exactly the number of
steps between them. One maximum over all of them says only the last. So the summary keeps them
apart: a column per part of the state (the weights, each optimizer state, MXFP8 data and scales),
each cell the largest max |Δ| and ‖Δ‖/‖B‖ among that kind's tensors of that part, or "equal"; and
the counters (Adam's ``step``, ``extra.step``: entries that are one number) as what they are,
``step: 30 → 60 (+30)``, in a column and a table of their own, with the objects that differ.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable

from mfsdp_ckpt.format.keys import group_of
from mfsdp_ckpt.tools.report.kinds import KINDS, WEIGHTS, layer_of, param_kind, part_of, part_order
from mfsdp_ckpt.tools.report.svg import esc

__all__ = ["Entry", "entries_of", "is_counter", "counter_label", "change", "worst", "num", "by_kind", "counters"]

#: groups whose entries are weights or planes of them: a one-element tensor there is a weight, not a counter
WEIGHT_GROUPS = ("model", "grad", "mx")


@dataclass(frozen=True)
class Entry:
    """One compared (or one-sided) entry as the summary sorts it. ``tensor``: a tensor on both
    sides (False for an object); ``counter``: one number on each side outside the weights
    (Adam's ``step``, ``extra.step``); the rest is the diff's, None where it found the entry equal."""

    key: str
    kind: str
    part: str
    tensor: bool = True
    counter: bool = False
    problem: str | None = None  # None: equal
    max_abs: float | None = None
    rel: float | None = None
    numbers: tuple[float, float] | None = None
    detail: str = ""

    @property
    def one_sided(self) -> bool:
        return self.problem in ("only in A", "only in B")


def is_counter(key: str, shape: tuple[int, ...] | None, numbers: tuple[float, float] | None) -> bool:
    """Whether an entry is a counter or another scalar of the optimizer or trainer state: outside
    the weights (``model``, ``grad``, ``mx``), an optimizer ``step``, a one-element tensor, or an
    object that is one number on both sides (``numbers``)."""
    if group_of(key) in WEIGHT_GROUPS:
        return False
    if numbers is not None or part_of(key) == "step":
        return True
    return shape is not None and math.prod(shape) == 1


def entries_of(
    common: Iterable[str],
    shapes: dict[str, tuple[int, ...] | None],
    rows: Iterable[object],
) -> list[Entry]:
    """Every common entry (equal or not) and every one-sided one, from the diff's ``common`` keys,
    A's ``shapes`` (key -> shape, None for an object; a key it lacks counts as a tensor) and the
    page's rows (``DiffRow``: key, problem, max_abs, rel, numbers, detail)."""
    by_key = {r.key: r for r in rows}  # type: ignore[attr-defined]
    out = []
    common = list(common)
    seen = set(common)
    for key in [*common, *(k for k in by_key if k not in seen)]:
        r = by_key.get(key)
        known, shape = key in shapes, shapes.get(key)
        numbers = getattr(r, "numbers", None)
        out.append(
            Entry(
                key,
                param_kind(key),
                part_of(key),
                tensor=not known or shape is not None,
                counter=is_counter(key, shape if known else None, numbers),
                problem=None if r is None else r.problem,
                max_abs=None if r is None else r.max_abs,
                rel=None if r is None else r.rel,
                numbers=numbers,
                detail="" if r is None else r.detail,
            )
        )
    return out


def num(x: float | None) -> str:
    """A number in 4 significant digits; ``-`` for none."""
    return "-" if x is None else ("nan" if isinstance(x, float) and math.isnan(x) else f"{x:.4g}")


def _short(x: float | None) -> str:
    """A ratio in 2 significant digits, for the second line of a cell."""
    return "-" if x is None else ("nan" if math.isnan(x) else f"{x:.2g}")


def _plain(x: float) -> str:
    """A counter's value: an integer as one (``30``), else 6 significant digits."""
    return str(int(x)) if math.isfinite(x) and x == int(x) and abs(x) < 1e15 else f"{x:.6g}"


def change(numbers: tuple[float, float]) -> str:
    """``30 → 60 (+30)``."""
    a, b = numbers
    d = b - a
    return f"{_plain(a)} → {_plain(b)} ({'+' if d >= 0 else '−'}{_plain(abs(d))})"


def counter_label(key: str) -> str:
    """What a counter is called in the summary: an optimizer state by its name (``step``), any
    other entry by its key (``extra.step``)."""
    return part_of(key) if group_of(key) == "optim" else key


def worst(values: list[float | None]) -> float | None:
    """The largest of ``values`` (NaN the largest of all), None when there is none."""
    present = [v for v in values if v is not None]
    if any(math.isnan(v) for v in present):
        return math.nan
    return max(present, default=None)


@dataclass
class _Cell:
    """The entries of one kind and part: how many were compared, and those that differ."""

    compared: int = 0
    differ: list[Entry] = field(default_factory=list)


def _matrix(entries: list[Entry]) -> tuple[dict[tuple[str, str], _Cell], list[str]]:
    """(kind, part) -> its cell, over the tensors that are not counters; and the parts seen, in order."""
    cells: dict[tuple[str, str], _Cell] = defaultdict(_Cell)
    for e in entries:
        if e.counter or not e.tensor or e.one_sided:
            continue
        cell = cells[e.kind, e.part]
        cell.compared += 1
        if e.problem is not None:
            cell.differ.append(e)
    parts = sorted({p for _, p in cells}, key=part_order)
    return cells, parts


def _cell(cell: _Cell | None, where: str) -> str:
    """One cell of the by-kind table: blank (no such tensors), ``equal``, or the largest max |Δ|
    with the largest ‖Δ‖/‖B‖ under it."""
    if cell is None or not cell.compared:
        return "<td></td>"
    if not cell.differ:
        tip = f"{where}: all {cell.compared} equal"
        return f'<td class="num eq" title="{esc(tip)}">equal</td>'
    top, rel = worst([e.max_abs for e in cell.differ]), worst([e.rel for e in cell.differ])
    problems = sorted({e.problem for e in cell.differ if e.problem not in ("values", "dtype")})
    shown = num(top) if top is not None else ", ".join(problems)
    tip = f"{where}: {len(cell.differ)} of {cell.compared} differ; largest max |Δ| {num(top)}, ‖Δ‖/‖B‖ {num(rel)}"
    some = "" if len(cell.differ) == cell.compared else f" · {len(cell.differ)} of {cell.compared}"
    return (
        f'<td class="num diff" data-max="{esc(num(top))}" data-rel="{esc(num(rel))}" title="{esc(tip)}">'
        f"{esc(shown)}<span class=sub>‖Δ‖/‖B‖ {esc(_short(rel))}{esc(some)}</span></td>"
    )


def _counters_cell(entries: list[Entry]) -> str:
    """The counters of one kind: each distinct change once (``step: 30 → 60 (+30)``), or ``equal``."""
    groups = _counter_groups(entries)
    if not groups:
        return "<td></td>" if not entries else '<td class="eq">equal</td>'
    lines = [f"{label}: {text}" for (label, text), keys in groups.items()]
    tip = "; ".join(f"{label}: {text} in {len(keys)} entries" for (label, text), keys in groups.items())
    shown = lines[:2] + ([f"… {len(lines) - 2} more"] if len(lines) > 2 else [])
    return f'<td class="counters" title="{esc(tip)}">{"<br>".join(esc(x) for x in shown)}</td>'


def _counter_groups(entries: Iterable[Entry]) -> dict[tuple[str, str], list[str]]:
    """(label, change) -> keys, for the counters that differ."""
    out: dict[tuple[str, str], list[str]] = defaultdict(list)
    for e in entries:
        if e.counter and e.problem is not None and not e.one_sided:
            text = change(e.numbers) if e.numbers else e.detail
            out[counter_label(e.key), text].append(e.key)
    return dict(sorted(out.items(), key=lambda item: -len(item[1])))  # the most shared first


#: what each part is, for its column's tooltip
_PART_TIPS = {
    WEIGHTS: "the model's weights (model.*), in the dtype the model computes in",
    "gradients": "the reduced gradients (grad.*)",
    "main_param": "the optimizer's fp32 main copy of a low-precision weight",
    "exp_avg": "Adam's first moment (the running mean of the gradients)",
    "exp_avg_sq": "Adam's second moment (the running mean of the squared gradients)",
    "momentum_buffer": "SGD's or Muon's momentum",
    "mx data": "MXFP8 elements (rowwise and columnwise planes) as stored, before their scales",
    "mx scale": "MXFP8 E8M0 scales, one per 32 elements (rowwise and columnwise planes)",
}


def _part_th(part: str, rowspan: int = 1) -> str:
    tip = _PART_TIPS.get(part, f"the optimizer state {part}" if _part_group(part) else part)
    span = f" rowspan={rowspan}" if rowspan > 1 else ""
    return f'<th{span} class="num part" data-part="{esc(part)}" title="{esc(tip)}">{esc(part)}</th>'


def _part_group(part: str) -> str | None:
    """The header over a part's column: ``optimizer state`` or ``MXFP8 planes``; None for the
    weights, their gradients and ``other``, which head their column alone."""
    if part in (WEIGHTS, "gradients", "other"):
        return None
    return "MXFP8 planes" if part.startswith("mx ") else "optimizer state"


def _part_header(parts: list[str]) -> str:
    """Two header rows: the part groups (optimizer state, MXFP8 planes) over their parts."""
    fixed = ("kind", "differ", "only in A", "only in B", "compared")
    top = [f"<th rowspan=2{'' if n == 'kind' else ' class=num'}>{esc(n)}</th>" for n in fixed]
    bottom = []
    i = 0
    while i < len(parts):
        group = _part_group(parts[i])
        if group is None:
            top.append(_part_th(parts[i], rowspan=2))
            i += 1
            continue
        end = i
        while end < len(parts) and _part_group(parts[end]) == group:
            end += 1
        span = parts[i:end]
        top.append(f'<th colspan={len(span)} class="part-group">{esc(group)}</th>')
        bottom += [_part_th(p) for p in span]
        i += len(span)
    top.append("<th rowspan=2>counters</th>")
    return f"<tr>{''.join(top)}</tr><tr>{''.join(bottom)}</tr>"


def by_kind(entries: list[Entry]) -> str:
    """The summary by kind: a row per kind (and one for all), a column per part of the state."""
    cells, parts = _matrix(entries)
    per_kind: dict[str, list[Entry]] = defaultdict(list)
    for e in entries:
        per_kind[e.kind].append(e)
    rows = [_kind_row(kind, per_kind[kind], cells, parts) for kind in KINDS if kind in per_kind]
    if len(rows) > 1:
        rows.append(_kind_row("all", entries, _all_cells(cells), parts))
    return (
        "<h2>summary by kind</h2><p class=note>each cell: the largest max |Δ| among the kind's tensors of "
        "that part of the state, under it the largest ‖Δ‖/‖B‖ (and how many differ, where not all do); "
        "<b>equal</b>: every one is the same (within <span class=nowrap>--atol/--rtol</span>, if given). "
        "Counters (Adam's step, extra.step: one number each) are apart, as their change. Click a row to show "
        "only its entries in the table below.</p>"
        f'<div class="scroll"><table id="by-kind">{_part_header(parts)}{"".join(rows)}</table></div>'
    )


def _all_cells(cells: dict[tuple[str, str], _Cell]) -> dict[tuple[str, str], _Cell]:
    """The cells of every kind together, as the ``all`` row's."""
    out: dict[tuple[str, str], _Cell] = defaultdict(_Cell)
    for (_, part), cell in cells.items():
        out["all", part].compared += cell.compared
        out["all", part].differ.extend(cell.differ)
    return out


def _kind_row(kind: str, entries: list[Entry], cells: dict[tuple[str, str], _Cell], parts: list[str]) -> str:
    one_sided = {side: sum(e.problem == f"only in {side}" for e in entries) for side in "AB"}
    differ = sum(e.problem is not None for e in entries) - one_sided["A"] - one_sided["B"]
    compared = sum(not e.one_sided for e in entries)
    pick = f'data-set-kind="{esc(kind)}" data-set-layer="" class="pick"' if kind != "all" else 'class="pick all"'
    tds = "".join(_cell(cells.get((kind, p)), f"{kind}, {p}") for p in parts)
    return (
        f"<tr {pick}><td>{esc(kind)}</td><td class=num>{differ}</td><td class=num>{one_sided['A']}</td>"
        f"<td class=num>{one_sided['B']}</td><td class=num>{compared}</td>{tds}"
        f"{_counters_cell([e for e in entries if e.counter])}</tr>"
    )


def counters(entries: list[Entry]) -> str:
    """The counters and objects that differ: each counter's change once, with how many entries
    share it (every ``optim.*.step`` at once), then each object with its first difference."""
    groups = _counter_groups(entries)
    objects = [e for e in entries if not e.tensor and not e.counter and e.problem is not None and not e.one_sided]
    if not groups and not objects:
        return ""
    rows = [
        f'<tr class="counter"><td><code>{esc(_pattern(keys))}</code></td><td class=num>{len(keys)}</td>'
        f"<td>{esc(text)}</td></tr>"
        for (_, text), keys in groups.items()
    ]
    rows += [
        f'<tr class="object"><td><code>{esc(e.key)}</code></td><td class=num>1</td><td>{esc(e.detail)}</td></tr>'
        for e in objects
    ]
    return (
        "<h2>counters and objects that differ</h2><p class=note>step counters and other one-number entries "
        "(A → B, and by how much), then objects (their first difference)</p>"
        f'<table id="counters"><tr><th>entries</th><th class=num>how many</th><th>A → B</th></tr>{"".join(rows)}</table>'
    )


def _pattern(keys: list[str]) -> str:
    """One name for keys that share a change: the key itself, or ``optim.*.step`` for many."""
    if len(keys) == 1:
        return keys[0]
    tails = {k.rsplit(".", 1)[-1] for k in keys}
    heads = {k.split(".", 1)[0] for k in keys}
    return f"{'|'.join(sorted(heads))}.*.{'|'.join(sorted(tails))}"


def layer_cells(entries: list[Entry]) -> dict[tuple[str, int | None], list[Entry]]:
    """(kind, layer) -> the tensors that differ or exist on one side only there (counters apart)."""
    out: dict[tuple[str, int | None], list[Entry]] = defaultdict(list)
    for e in entries:
        if e.problem is not None and not e.counter:
            out[e.kind, layer_of(e.key)].append(e)
    return out
