"""The drawings of the HTML report, as SVG text: a strip per rank of the bytes it wrote, a tensor
with the boxes each rank wrote of it, and a histogram.

Every string from a checkpoint passes through :func:`esc` before it is placed in markup: a
checkpoint is untrusted input. Output is deterministic for the same layout (a snapshot test pins it).
"""

from __future__ import annotations

import colorsys
import hashlib
import html
import math
from typing import Sequence

from mfsdp_ckpt.format.base_ref import shown_file
from mfsdp_ckpt.tools.report.layout import ChunkView

__all__ = [
    "esc",
    "rank_color",
    "tensor_color",
    "rank_strips",
    "tensor_boxes",
    "histogram",
    "short_count",
    "human_bytes",
    "MX_BLOCK_ROWS",
]

#: the colours of ranks 0-9 (and again, lighter, past 10)
_RANK_PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22")
#: MXFP8 scales cover 32 rows of the columnwise plane: block boundaries drawn every 32 rows
MX_BLOCK_ROWS = 32
STRIP_WIDTH = 720
STRIP_HEIGHT = 18
LABEL_WIDTH = 190
#: chunks drawn one by one per strip; past this, neighbouring chunks are merged into equal-byte bins
MAX_RECTS_PER_STRIP = 240


def esc(value: object) -> str:
    """Text safe inside an element and inside a double-quoted attribute."""
    return html.escape(str(value), quote=True)


def rank_color(rank: int | None) -> str:
    if rank is None:
        return "#555555"
    return _RANK_PALETTE[rank % len(_RANK_PALETTE)]


def tensor_color(key: str) -> str:
    """A pale colour per tensor name (stable across runs), distinct from the rank colours."""
    h = int.from_bytes(hashlib.blake2s(key.encode(), digest_size=4).digest(), "big")
    r, g, b = colorsys.hls_to_rgb((h % 360) / 360.0, 0.78, 0.55)
    return f"#{round(r * 255):02x}{round(g * 255):02x}{round(b * 255):02x}"


def human_bytes(n: float) -> str:
    """``1.5 KiB``: binary units, as the rest of the CLI prints them."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _box(c: ChunkView) -> str:
    if not c.offsets:
        return "object"
    return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(c.offsets, c.sizes or c.offsets)) + "]"


def rank_strips(group: str, chunks: Sequence[ChunkView], ranks: Sequence[int], labels: dict[int, str]) -> str:
    """One strip per rank: the bytes of ``group`` that rank wrote, in file order, each chunk as
    wide as its bytes (one scale for every rank, so imbalance shows), coloured by tensor, with
    a tooltip naming the tensor, the box and the file range."""
    per_rank: dict[int, list[ChunkView]] = {r: [] for r in ranks}
    for c in chunks:
        if c.rank is not None:
            per_rank.setdefault(c.rank, []).append(c)
    widest = max((sum(c.length for c in cs) for cs in per_rank.values()), default=0) or 1
    scale = (STRIP_WIDTH - LABEL_WIDTH - 90) / widest
    height = STRIP_HEIGHT + 6
    parts = [
        f'<svg class="strips" data-group="{esc(group)}" xmlns="http://www.w3.org/2000/svg" '
        f'width="{STRIP_WIDTH}" height="{height * len(per_rank) + 4}" role="img">'
    ]
    for row, (rank, cs) in enumerate(sorted(per_rank.items())):
        y = 2 + row * height
        total = sum(c.length for c in cs)
        parts.append(f'<g class="strip" data-rank="{rank}" data-chunks="{len(cs)}">')
        parts.append(f'<rect x="0" y="{y}" width="14" height="{STRIP_HEIGHT}" fill="{rank_color(rank)}"/>')
        parts.append(f'<text x="20" y="{y + 13}">{esc(labels.get(rank, f"rank {rank}"))}</text>')
        x = float(LABEL_WIDTH)
        for title, color, length in _strip_cells(sorted(cs, key=lambda c: (c.file, c.file_offset))):
            w = length * scale
            parts.append(
                f'<rect x="{x:.2f}" y="{y}" width="{max(w, 0.5):.2f}" height="{STRIP_HEIGHT}" fill="{color}" '
                f'stroke="#ffffff" stroke-width="0.5"><title>{esc(title)}</title></rect>'
            )
            x += w
        parts.append(f'<text x="{LABEL_WIDTH + total * scale + 6:.2f}" y="{y + 13}">{esc(human_bytes(total))}</text>')
        parts.append("</g>")
    parts.append("</svg>")
    return "".join(parts)


def _strip_cells(cs: list[ChunkView]) -> list[tuple[str, str, int]]:
    """(tooltip, colour, bytes) per drawn cell: one per chunk, or equal-byte bins of several
    chunks past :data:`MAX_RECTS_PER_STRIP` (grey, the tooltip naming the first and last)."""
    if len(cs) <= MAX_RECTS_PER_STRIP:
        return [
            (
                f"{c.key} {_box(c)}: {shown_file(c.file)} bytes {c.file_offset}-{c.file_offset + c.length} "
                f"({human_bytes(c.length)})",
                tensor_color(c.key),
                c.length,
            )
            for c in cs
        ]
    per_bin = -(-len(cs) // MAX_RECTS_PER_STRIP)
    cells = []
    for i in range(0, len(cs), per_bin):
        part = cs[i : i + per_bin]
        length = sum(c.length for c in part)
        title = (
            f"{len(part)} chunks, {human_bytes(length)}: {part[0].key} ... {part[-1].key} ({shown_file(part[0].file)})"
        )
        cells.append((title, "#c8ccd2" if (i // per_bin) % 2 else "#b4b9c1", length))
    return cells


def tensor_boxes(key: str, shape: Sequence[int], chunks: Sequence[ChunkView], mx: bool) -> str:
    """The tensor as a rectangle (rows down, columns across; a 1-D tensor as a bar) with the box
    each rank wrote filled in that rank's colour; for an MXFP8 weight, a line at every 32-row
    block boundary (where shards of it may start)."""
    rows, cols = (shape[0], 1) if len(shape) == 1 else (shape[0] if shape else 1, math.prod(shape[1:]) or 1)
    width, height = 240, (12 if len(shape) <= 1 else max(12, min(96, round(240 * rows / max(cols, 1)))))
    parts = [
        f'<svg class="tensor" xmlns="http://www.w3.org/2000/svg" width="{width + 2}" height="{height + 2}" role="img">',
        f'<rect x="1" y="1" width="{width}" height="{height}" fill="#f4f4f4" stroke="#999999"/>',
    ]
    for c in chunks:
        if not c.sizes:
            continue
        r0, nr = c.offsets[0], c.sizes[0]
        if len(shape) == 1:
            x, w, y, h = width * r0 / max(rows, 1), width * nr / max(rows, 1), 0.0, float(height)
        else:
            c0 = c.offsets[1] if len(c.offsets) > 1 else 0
            nc = math.prod(c.sizes[1:]) if len(c.sizes) > 1 else cols
            x, w = width * c0 / cols, width * nc / cols
            y, h = height * r0 / max(rows, 1), height * nr / max(rows, 1)
        parts.append(
            f'<rect class="box" data-rank="{c.rank}" x="{1 + x:.2f}" y="{1 + y:.2f}" width="{max(w, 0.5):.2f}" '
            f'height="{max(h, 0.5):.2f}" fill="{rank_color(c.rank)}" fill-opacity="0.85" stroke="#ffffff" '
            f'stroke-width="0.5"><title>{esc(f"rank {c.rank}: {_box(c)} in {shown_file(c.file)}")}</title></rect>'
        )
    if mx and len(shape) >= 2 and rows > MX_BLOCK_ROWS and rows // MX_BLOCK_ROWS <= 64:
        for b in range(MX_BLOCK_ROWS, rows, MX_BLOCK_ROWS):
            y = 1 + height * b / rows
            parts.append(
                f'<line class="mx-block" x1="1" x2="{width + 1}" y1="{y:.2f}" y2="{y:.2f}" stroke="#000000" '
                'stroke-width="0.6" stroke-dasharray="3,2"/>'
            )
    parts.append("</svg>")
    return "".join(parts)


def short_count(n: int) -> str:
    """``7``, ``950``, ``1.2k``, ``34k``, ``5.6M``: at most 4 characters, so counts fit over their bars."""
    if n < 1000:
        return str(n)
    for div, unit in ((10**3, "k"), (10**6, "M"), (10**9, "G"), (10**12, "T")):
        v = n / div
        if v < 9.95:
            return f"{v:.1f}{unit}"
        if round(v) < 1000:
            return f"{round(v)}{unit}"
    return f"{n:.0e}"


#: a histogram's geometry: bin pitch, bar width, tallest bar, and the rows of its two labels
HIST_PITCH, HIST_BAR, HIST_FONT = 46, 38, 10


def histogram(labels: Sequence[str], counts: Sequence[int], *, trim: bool = False, height: int = 40) -> str:
    """Bars of ``counts`` (log-scaled heights, so a single outlier still shows), each with its
    count above it and its bin's label below. Every bin is :data:`HIST_PITCH` wide and no label
    is longer than a bin (6 characters of a 10 px monospace font), so labels never overlap.
    ``trim`` draws only the bins from the first to the last non-empty one (a table row's)."""
    bins = list(zip(labels, counts))
    if trim:
        filled = [i for i, (_, n) in enumerate(bins) if n]
        bins = bins[filled[0] : filled[-1] + 1] if filled else bins[:1]
    top = max((math.log10(1 + n) for _, n in bins), default=0) or 1
    count_row, width = HIST_FONT + 2, len(bins) * HIST_PITCH
    base = count_row + height
    parts = [
        f'<svg class="hist" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{base + HIST_FONT + 6}" '
        f'role="img" font-size="{HIST_FONT}">',
        f'<line x1="0" x2="{width}" y1="{base + 0.5}" y2="{base + 0.5}" stroke="#999999" stroke-width="1"/>',
    ]
    for i, (label, n) in enumerate(bins):
        h = height * math.log10(1 + n) / top
        x, mid, shown = i * HIST_PITCH + (HIST_PITCH - HIST_BAR) / 2, (i + 0.5) * HIST_PITCH, label.replace("<=", "≤")
        parts.append(
            f'<rect x="{x:.1f}" y="{base - h:.2f}" width="{HIST_BAR}" height="{h:.2f}" fill="#d62728">'
            f"<title>{esc(f'|Δ| {shown}: {n:,} elements')}</title></rect>"
        )
        if n:
            parts.append(
                f'<text class="count" x="{mid}" y="{base - h - 2:.2f}" text-anchor="middle">{short_count(n)}</text>'
            )
        parts.append(f'<text class="bin" x="{mid}" y="{base + HIST_FONT + 3}" text-anchor="middle">{esc(shown)}</text>')
    parts.append("</svg>")
    return "".join(parts)
