"""``diff --html``: which tensors of two checkpoints differ, by how much, and how each side was laid out."""

from __future__ import annotations

import math
import os

from mfsdp_ckpt.tools.diff import HISTOGRAM_BINS, CheckpointDiff
from mfsdp_ckpt.tools.inspect import CheckpointInfo, inspect_checkpoint
from mfsdp_ckpt.tools.report.page import page, write_page
from mfsdp_ckpt.tools.report.svg import esc, histogram

__all__ = ["diff_html", "render_diff"]


def diff_html(a: str | os.PathLike, b: str | os.PathLike, result: CheckpointDiff, out: str | os.PathLike) -> str:
    """Write the page of ``result`` (``diff_checkpoints(a, b)``) to ``out``; returns ``out``."""
    return write_page(render_diff(inspect_checkpoint(a), inspect_checkpoint(b), result), out)


def _layout(info: CheckpointInfo) -> str:
    if not info.writer:
        return f"{info.format}: writer layout not recorded"
    buffers = "; ".join(
        f"{x.get('strategy')}/{x.get('policy')} over {x.get('group_size')} ({x.get('group', 'dp')})"
        for x in info.writer.get("buffers", [])
    )
    return f"{info.format}, world size {info.writer.get('world_size')}: {buffers}"


def _num(x: float | None) -> str:
    return "-" if x is None else ("nan" if isinstance(x, float) and math.isnan(x) else f"{x:.4g}")


def render_diff(a: CheckpointInfo, b: CheckpointInfo, result: CheckpointDiff) -> str:
    verdict = "equal" if result.equal else "different"
    body = [
        f"<h1>diff: {esc(verdict)}</h1><table>",
        *(
            f"<tr><th>{side}</th><td><code>{esc(info.path)}</code></td><td>step {esc(info.step)}</td>"
            f"<td><code>{esc(_layout(info))}</code></td></tr>"
            for side, info in (("A", a), ("B", b))
        ),
        "</table>",
        f"<p>{result.compared} common entries compared: {len(result.different)} differ, "
        f"{len(result.only_in_a)} only in A, {len(result.only_in_b)} only in B.</p>",
    ]
    rows = []
    for d in result.different:
        hist = histogram(HISTOGRAM_BINS, d.histogram) if d.histogram else ""
        rows.append(
            f'<tr class="differs" data-key="{esc(d.key)}"><td class=key>{esc(d.key)}</td><td>{esc(d.problem)}</td>'
            f"<td class=num>{esc(_num(d.max_abs))}</td><td class=num>{esc(_num(d.rel))}</td>"
            f"<td>{esc(d.detail)}{hist}</td></tr>"
        )
    rows += [
        f'<tr class="differs" data-key="{esc(k)}"><td class=key>{esc(k)}</td><td>only in {side}</td>'
        "<td></td><td></td><td></td></tr>"
        for side, keys in (("A", result.only_in_a), ("B", result.only_in_b))
        for k in keys
    ]
    head = (
        "<tr><th>key</th><th>problem</th><th class=num>max |Δ|</th><th class=num>‖Δ‖/‖B‖</th>"
        "<th>detail, and a histogram of |Δ| (elements per bin, log height)</th></tr>"
    )
    body.append(f"<h2>differences</h2><table id='entries'>{head}{''.join(rows)}</table>")
    return page(f"diff {a.path} {b.path}", "".join(body))
