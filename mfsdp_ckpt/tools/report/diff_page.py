"""``diff --html``: which tensors of two checkpoints differ, by how much, and how each side was laid out.

The page holds a summary by kind (embeddings, attention, MLP, experts, norms, LoRA adapters) with
a column per part of the state (the weights, each optimizer state, MXFP8 planes: a weight's change
is never lost in a step counter's or an Adam moment's), the counters and objects that differ, a
summary by layer, a histogram of |Δ| per part, and a table of every difference that sorts by any
column (click its header) and filters by name, group, kind, layer and problem; clicking a cell of
the summary filters the table to it. Histograms carry their counts; bin labels never overlap.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from dataclasses import dataclass

from mfsdp_ckpt.format.keys import group_of
from mfsdp_ckpt.tools.diff import HISTOGRAM_BINS, CheckpointDiff
from mfsdp_ckpt.tools.inspect import CheckpointInfo, inspect_checkpoint
from mfsdp_ckpt.tools.report.diff_summary import (
    Entry,
    by_kind,
    change,
    counter_label,
    counters,
    entries_of,
    is_counter,
    layer_cells,
    num,
    worst,
)
from mfsdp_ckpt.tools.report.kinds import KINDS, WEIGHTS, layer_of, param_kind, part_of, part_order
from mfsdp_ckpt.tools.report.output import check_report_out
from mfsdp_ckpt.tools.report.page import page, write_page
from mfsdp_ckpt.tools.report.svg import esc, histogram

__all__ = ["DiffRow", "diff_rows", "diff_html", "render_diff"]

#: the table's columns: (header, sort type, tooltip)
_COLUMNS = (
    ("key", "text", "the checkpoint key"),
    ("group", "text", "model / optim / grad / mx / extra"),
    ("kind", "text", "what part of the model the key belongs to"),
    ("layer", "num", "the layer index in the key (- outside the layers)"),
    ("problem", "text", "values, shape, dtype, object, counter (one number each side), or only on one side"),
    ("max |Δ|", "num", "the largest |a - b| (NaN against a number counts as the largest)"),
    ("‖Δ‖/‖B‖", "num", "the norm of the difference over the norm of B"),
    ("elements ≠", "num", "elements with |a - b| > 0"),
    ("detail, and |Δ| per bin (elements, log height)", "text", "where the largest difference is"),
)


@dataclass(frozen=True)
class DiffRow:
    """One differing (or one-sided) entry, with the kind and layer its name says."""

    key: str
    group: str
    kind: str
    layer: int | None
    problem: str
    max_abs: float | None = None
    rel: float | None = None
    histogram: list[int] | None = None
    detail: str = ""
    numbers: tuple[float, float] | None = None  # (a, b) where each side is one number

    @property
    def differing(self) -> int | None:
        """Elements whose |a - b| is not 0 (None where no histogram was made)."""
        return sum(self.histogram[1:]) if self.histogram else None


def diff_rows(result: CheckpointDiff, shapes: dict[str, tuple[int, ...] | None] | None = None) -> list[DiffRow]:
    """Every row of the table: the differing entries, then those only in A, then only in B. A
    counter (Adam's ``step``, ``extra.step``; ``shapes``: key -> shape, None for an object) is
    problem ``counter``, its detail the change (``step: 30 → 60 (+30)``), with no max |Δ|."""
    shapes = shapes or {}

    def row(key: str, problem: str, **more: object) -> DiffRow:
        return DiffRow(key, group_of(key), param_kind(key), layer_of(key), problem, **more)  # type: ignore[arg-type]

    rows = []
    for d in result.different:
        if d.problem in ("values", "object") and is_counter(d.key, shapes.get(d.key), d.numbers) and d.numbers:
            rows.append(row(d.key, "counter", detail=f"{counter_label(d.key)}: {change(d.numbers)}", numbers=d.numbers))
        else:
            more = {"max_abs": d.max_abs, "rel": d.rel, "histogram": d.histogram, "numbers": d.numbers}
            rows.append(row(d.key, d.problem, detail=d.detail, **more))
    rows += [row(k, "only in A") for k in result.only_in_a]
    return rows + [row(k, "only in B") for k in result.only_in_b]


def diff_html(a: str | os.PathLike, b: str | os.PathLike, result: CheckpointDiff, out: str | os.PathLike) -> str:
    """Write the page of ``result`` (``diff_checkpoints(a, b)``) to ``out``; returns ``out``. An
    ``out`` that is, lies inside or contains ``a`` or ``b`` is refused before anything is read."""
    check_report_out(out, [a, b])
    return write_page(render_diff(inspect_checkpoint(a), inspect_checkpoint(b), result), out)


def _layout(info: CheckpointInfo) -> str:
    if not info.writer:
        return f"{info.format}: writer layout not recorded"
    buffers = "; ".join(
        f"{x.get('strategy')}/{x.get('policy')} over {x.get('group_size')} ({x.get('group', 'dp')})"
        for x in info.writer.get("buffers", [])
    )
    return f"{info.format}, world size {info.writer.get('world_size')}: {buffers}"


def _sort_value(x: float | None) -> str:
    """A cell's ``data-v``: NaN sorts as the largest (a NaN against a number is the worst
    mismatch), a missing value as the smallest."""
    if x is None:
        return "-Infinity"
    return "Infinity" if math.isnan(x) or math.isinf(x) else repr(float(x))


def render_diff(a: CheckpointInfo, b: CheckpointInfo, result: CheckpointDiff) -> str:
    """The page: both sides, the verdict, the summaries and the table of differences."""
    verdict = "equal" if result.equal else "different"
    shapes = {t.key: t.shape for info in (a, b) for t in info.tensors}  # for the entries only one side has
    shapes.update(result.shapes)
    rows = diff_rows(result, shapes)
    entries = entries_of(result.shapes, shapes, rows)
    body = [
        f"<h1>diff: {esc(verdict)}</h1><table>",
        *(
            f"<tr><th>{side}</th><td><code>{esc(info.path)}</code></td>"
            f"<td>step {esc('unknown' if info.step is None else info.step)}</td>"
            f"<td><code>{esc(_layout(info))}</code></td></tr>"
            for side, info in (("A", a), ("B", b))
        ),
        "</table>",
        f"<p>{result.compared} common entries compared: {len(result.different)} differ, "
        f"{len(result.only_in_a)} only in A, {len(result.only_in_b)} only in B.</p>",
    ]
    if entries:
        body.append(by_kind(entries))
    if rows:
        body += [counters(entries), _by_layer(entries), _overall(rows)]
    body.append(_table(rows))
    return page(f"diff {a.path} {b.path}", "".join(body))


def _shade(rel: float | None) -> str:
    """A cell's background: pale for a tiny ‖Δ‖/‖B‖, deep red from 1 up (log scale from 1e-8)."""
    if rel is None:
        return "#eeeeee"
    t = 1.0 if math.isnan(rel) else min(1.0, max(0.0, (math.log10(max(rel, 1e-12)) + 8) / 8))
    g = round(235 - 170 * t)
    return f"#f0{g:02x}{g:02x}" if t < 1 else "#d62728"


def _layer_tip(where: str, kind: str, entries: list[Entry], rel: float | None, of: str) -> str:
    """A cell's tooltip: how many entries of each part differ there, and the shade's value."""
    parts: dict[str, int] = defaultdict(int)
    for e in entries:
        parts[e.part] += 1
    split = ", ".join(f"{n} {p}" for p, n in sorted(parts.items(), key=lambda pn: part_order(pn[0])))
    return f"{where}, {kind}: {len(entries)} entries ({split}); largest ‖Δ‖/‖B‖ of the {of} {num(rel)}"


def _by_layer(entries: list[Entry]) -> str:
    """A row per kind, a column per layer (and one for what sits outside the layers): how many
    tensors differ there (counters apart), shaded by the largest ‖Δ‖/‖B‖ of the weights among
    them (of the rest where no weight differs)."""
    cells = layer_cells(entries)
    if not cells:
        return ""
    seen = {layer for _, layer in cells}
    layers = ([None] if None in seen else []) + sorted(x for x in seen if x is not None)
    out = []
    for kind in (k for k in KINDS if any(kk == k for kk, _ in cells)):
        tds = []
        for layer in layers:
            es = cells.get((kind, layer), [])
            if not es:
                tds.append("<td></td>")
                continue
            weights = [e for e in es if e.part == WEIGHTS]
            of = "weights" if weights else "other tensors"
            rel = worst([e.rel for e in (weights or es)])
            tip = _layer_tip("outside the layers" if layer is None else f"layer {layer}", kind, es, rel, of)
            tds.append(
                f'<td class="num pick" style="background:{_shade(rel)}" data-set-kind="{esc(kind)}" '
                f'data-set-layer="{"-" if layer is None else layer}" title="{esc(tip)}">{len(es)}</td>'
            )
        out.append(f"<tr><th>{esc(kind)}</th>{''.join(tds)}</tr>")
    head = '<tr><th class="corner">kind \\ layer</th>' + "".join(
        f"<th class=num>{'-' if x is None else x}</th>" for x in layers
    )
    return (
        "<h2>summary by layer</h2><p class=note>tensors that differ (or exist on one side only) per kind and "
        "layer (-: outside the layers; counters apart); the shade is the cell's largest ‖Δ‖/‖B‖ of the weights "
        "(of the optimizer state where no weight differs; log scale, white 1e-8, red 1 or more); click a cell to "
        "filter the table</p>"
        f'<div class="scroll"><table id="by-layer" class="matrix">{head}</tr>{"".join(out)}</table></div>'
    )


def _overall(rows: list[DiffRow]) -> str:
    """A histogram of |Δ| over every element of the differing tensors, one per part of the state
    (weights, each optimizer state, MXFP8 planes), on the same bins: their scales side by side."""
    per_part: dict[str, list[list[int]]] = defaultdict(list)
    for r in rows:
        if r.histogram:
            per_part[part_of(r.key)].append(r.histogram)
    if not per_part:
        return ""
    tables = []
    for part in sorted(per_part, key=part_order):
        hists = per_part[part]
        total = [sum(col) for col in zip(*hists)]
        tables.append(
            f'<tr data-part="{esc(part)}"><th>{esc(part)}<span class="note block">{len(hists)} tensors</span></th>'
            f"<td>{histogram(HISTOGRAM_BINS, total, height=50)}</td></tr>"
        )
    n = sum(len(h) for h in per_part.values())
    return (
        f"<h2>|Δ| of every element of the {n} differing tensors, by part</h2>"
        "<p class=note>elements per bin (the count over each bar; log heights); bins are decades of |a - b|, the "
        "same for every part</p>"
        f'<div id="overall"><table class="hists">{"".join(tables)}</table></div>'
    )


def _select(name: str, values: list[str]) -> str:
    options = "".join(f'<option value="{esc(v)}">{esc(v)}</option>' for v in values)
    return (
        f'<label>{esc(name)} <select data-filter="{esc(name)}"><option value="">all</option>{options}</select></label>'
    )


def _table(rows: list[DiffRow]) -> str:
    """Every difference: sortable by any column, filtered by the search box and the selects."""
    layers = sorted({r.layer for r in rows if r.layer is not None})
    filters = " ".join(
        [
            _select("group", sorted({r.group for r in rows})),
            _select("kind", [k for k in KINDS if any(r.kind == k for r in rows)]),
            _select("layer", [str(x) for x in layers] + (["-"] if any(r.layer is None for r in rows) else [])),
            _select("problem", sorted({r.problem for r in rows})),
        ]
    )
    head = "".join(
        f'<th data-sort="{kind}" title="{esc(tip)}"{" class=num" if kind == "num" else ""}>{esc(name)}</th>'
        for name, kind, tip in _COLUMNS
    )
    body = "".join(_row(r) for r in rows)
    return (
        f"<h2>differences ({len(rows)})</h2><p class=note>click a column's header to sort by it (again to reverse)</p>"
        f'<div class="filters">{filters}</div>'
        f"<table id='entries' class='sortable'><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
    )


def _row(r: DiffRow) -> str:
    layer = "-" if r.layer is None else str(r.layer)
    hist = histogram(HISTOGRAM_BINS, r.histogram, trim=True) if r.histogram else ""
    differing = r.differing
    return (
        f'<tr class="differs" data-key="{esc(r.key)}" data-group="{esc(r.group)}" data-kind="{esc(r.kind)}" '
        f'data-layer="{layer}" data-problem="{esc(r.problem)}">'
        f"<td class=key>{esc(r.key)}</td><td>{esc(r.group)}</td><td>{esc(r.kind)}</td>"
        f'<td class=num data-v="{-1 if r.layer is None else r.layer}">{layer}</td><td>{esc(r.problem)}</td>'
        f'<td class=num data-v="{_sort_value(r.max_abs)}">{esc(num(r.max_abs))}</td>'
        f'<td class=num data-v="{_sort_value(r.rel)}">{esc(num(r.rel))}</td>'
        f'<td class=num data-v="{-1 if differing is None else differing}">'
        f"{'-' if differing is None else f'{differing:,}'}</td>"
        f'<td><div class="detail">{esc(r.detail)}</div>{hist}</td></tr>'
    )
