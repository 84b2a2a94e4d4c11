"""``inspect --html``: one page showing where every chunk of a checkpoint lives, what model it
holds and, for a LoRA fine-tune or any checkpoint that reads frozen weights from a base, what
trains and what is frozen."""

from __future__ import annotations

import os
from collections import defaultdict

from mfsdp_ckpt.format.base_ref import shown_file, split_base_file
from mfsdp_ckpt.format.keys import GROUPS
from mfsdp_ckpt.tools.inspect import compact_ranges
from mfsdp_ckpt.tools.report.frozen import Frozen, frozen_of, frozen_section, frozen_summary
from mfsdp_ckpt.tools.report.layout import CheckpointLayout, checkpoint_layout
from mfsdp_ckpt.tools.report.model_table import ModelSummary, model_section, model_summary
from mfsdp_ckpt.tools.report.output import check_report_out
from mfsdp_ckpt.tools.report.page import page, write_page
from mfsdp_ckpt.tools.report.svg import esc, human_bytes, rank_strips, tensor_boxes

__all__ = ["inspect_html", "render_inspect", "MAX_TENSOR_DRAWINGS"]

#: tensors drawn per group; the rest are listed in the table (searchable) and counted
MAX_TENSOR_DRAWINGS = 120


def inspect_html(path: str | os.PathLike, out: str | os.PathLike) -> str:
    """Write the report of the checkpoint at ``path`` to ``out``; returns ``out``. An ``out`` that
    is, lies inside or contains the checkpoint is refused before anything is read."""
    check_report_out(out, [path])
    return write_page(render_inspect(checkpoint_layout(path)), out)


def rank_labels(layout: CheckpointLayout) -> dict[int, str]:
    """``rank 2 · EP 2 · replica 0`` per writer rank."""
    out = {}
    for r in layout.ranks:
        label = f"rank {r}"
        if (p := layout.ep_rank_of(r)) is not None:
            label += f" · EP {p}"
        if (k := layout.replica_of(r)) is not None:
            label += f" · replica {k}"
        out[r] = label
    return out


def render_inspect(layout: CheckpointLayout) -> str:
    info = layout.info
    model = model_summary(info, layout.manifest)
    frozen = frozen_of(layout)
    body = [
        f"<h1>checkpoint <code>{esc(info.path)}</code></h1>",
        _summary(layout, model, frozen),
        model_section(model),
        frozen_section(frozen),
    ]
    body += _files(layout) + _experts(layout) + _mx(layout) + _padding(layout)
    by_group: dict[str, list] = defaultdict(list)
    for c in layout.chunks:
        by_group[c.group].append(c)
    labels = rank_labels(layout)
    mx_names = {m.fqn for m in info.mx}
    tensors = {t.key: t for t in info.tensors}
    for group in (*GROUPS, "other"):
        chunks = by_group.get(group)
        if not chunks:
            continue
        body.append(f'<h2 id="group-{esc(group)}">{esc(group)}: what each rank wrote</h2>')
        body.append(rank_strips(group, chunks, layout.ranks, labels))
        per_key: dict[str, list] = defaultdict(list)
        for c in chunks:
            per_key[c.key].append(c)
        drawn = [k for k in per_key if tensors.get(k) and tensors[k].shape][:MAX_TENSOR_DRAWINGS]
        cards = []
        for key in drawn:
            t = tensors[key]
            is_mx = key.removeprefix("model.") in mx_names
            cards.append(
                f'<div class="tensor-card" data-key="{esc(key)}"><span class="key">{esc(key)}</span>'
                f"{tensor_boxes(key, t.shape, per_key[key], is_mx)}"
                f'<span class="note">{esc("x".join(map(str, t.shape)))} {esc(t.dtype)}, {len(per_key[key])} chunk(s)'
                f"{', MXFP8: 32-row blocks' if is_mx else ''}{esc(_role(key, frozen))}</span></div>"
            )
        body.append(f'<div class="tensors">{"".join(cards)}</div>')
        rest = len([k for k in per_key if tensors.get(k) and tensors[k].shape]) - len(drawn)
        if rest > 0:
            body.append(f'<p class="note">{rest} more tensors of this group are listed in the table below.</p>')
    body += _table(layout, frozen)
    return page(f"checkpoint {info.path}", "".join(body))


def _role(key: str, frozen: Frozen) -> str:
    """``, frozen (in the base)`` / ``, LoRA adapter`` for a tensor's card; else nothing."""
    if key in frozen.base_keys:
        return ", frozen (in the base)"
    if key in frozen.adapter_keys:
        return ", LoRA adapter"
    return ""


def _summary(layout: CheckpointLayout, model: ModelSummary, frozen: Frozen) -> str:
    """Format, step, a one-line model (its table and raw config follow in the "model" section),
    its LoRA adapters and base (the "LoRA fine-tune" section has them in full), the writer's layout."""
    info = layout.info
    facts = dict(model.facts)
    rows = [
        ("format", info.format + ("" if info.committed else " (no mfsdp.json)")),
        ("step", info.step if info.step is not None else "unknown"),
        ("model", f"{facts['family']} · {facts['architecture']} · {model.params:,} parameters"),
        *frozen_summary(frozen),
    ]
    if info.writer:
        layouts = "; ".join(
            f"{b.get('strategy')}/{b.get('policy')} over {b.get('group_size')} ({b.get('group', 'dp')})"
            for b in info.writer.get("buffers", [])
        )
        rows.append(("writer", f"world size {info.writer.get('world_size')}: {layouts}"))
    if layout.replicas > 1:
        rows.append(("HSDP", f"{layout.replicas} replica groups"))
    if info.unknown:
        rows.append(("unknown", ", ".join(info.unknown)))
    cells = "".join(f"<tr><th>{esc(k)}</th><td><code>{esc(v)}</code></td></tr>" for k, v in rows)
    return f'<table class="summary">{cells}</table>'


def _files(layout: CheckpointLayout) -> list[str]:
    """Every data file, with the rank that wrote it; a base's files under its directory's name."""
    rows = []
    for name, f in layout.files().items():
        c = next(c for c in layout.chunks if c.file == name)
        replica = layout.replica_of(c.rank) if c.rank is not None else None
        base = split_base_file(name)
        held = ' <span class="note">(the base: frozen weights)</span>' if base else ""
        rows.append(
            f"<tr><td><code>{esc(shown_file(name))}</code>{held}</td><td class=num>{esc(c.rank)}</td>"
            f"<td class=num>{esc('' if replica is None else replica)}</td><td class=num>{f['chunks']}</td>"
            f"<td class=num>{esc(human_bytes(f['bytes']))}</td></tr>"
        )
    head = "<tr><th>file</th><th>writer rank</th><th>replica</th><th>chunks</th><th>bytes</th></tr>"
    return ["<h2>data files</h2>", f"<table>{head}{''.join(rows)}</table>"]


def _experts(layout: CheckpointLayout) -> list[str]:
    x = layout.info.experts
    if x is None:
        return []
    rows = "".join(
        f"<tr><td class=num>{p}</td><td>{esc(compact_ranges(r))}</td><td>{esc(compact_ranges(e))}</td></tr>"
        for p, (r, e) in enumerate(zip(x.ranks, x.experts))
    )
    head = "<tr><th>EP rank</th><th>global ranks</th><th>global experts</th></tr>"
    return [
        f"<h2>expert parallelism: EP size {x.ep_size}, {x.num_experts} experts</h2>",
        f"<table>{head}{rows}</table>",
    ]


def _mx(layout: CheckpointLayout) -> list[str]:
    if not layout.info.mx:
        return []
    rows = "".join(
        f'<tr data-key="{esc(m.fqn)}"><td class=key>{esc(m.fqn)}</td><td>{esc("x".join(map(str, m.shape)))}</td>'
        f"<td>{esc(m.format)}</td><td>{esc(', '.join(m.planes))}</td></tr>"
        for m in layout.info.mx
    )
    head = "<tr><th>parameter</th><th>shape</th><th>format</th><th>planes</th></tr>"
    return ["<h2>MXFP8 weights (sharded on whole 32-element blocks)</h2>", f"<table>{head}{rows}</table>"]


def _padding(layout: CheckpointLayout) -> list[str]:
    if not layout.buffers:
        return []
    rows = "".join(
        f"<tr><td><code>{esc(b.unit)}</code></td><td class=num>{b.params}</td><td>{esc(b.strategy)}</td>"
        f"<td>{esc(b.policy)}</td><td>{esc(b.group)} ({b.group_size})</td><td class=num>{b.elements}</td>"
        f"<td class=num>{b.padding}</td><td><code>{esc(', '.join(map(str, b.per_rank)))}</code></td></tr>"
        for b in layout.buffers
    )
    head = (
        "<tr><th>unit</th><th>params</th><th>strategy</th><th>policy</th><th>group</th><th>elements</th>"
        "<th>padding</th><th>padding per rank</th></tr>"
    )
    return ["<h2>flat buffers and their padding</h2>", f"<table>{head}{rows}</table>"]


def _table(layout: CheckpointLayout, frozen: Frozen) -> list[str]:
    """Every entry; with a base, where each is stored (this checkpoint or the base) and, where
    known, whether a weight trains."""
    writers: dict[str, set[int]] = defaultdict(set)
    for c in layout.chunks:
        if c.rank is not None:
            writers[c.key].add(c.rank)
    base_name = (frozen.base or {}).get("name", "the base")
    with_base = frozen.base is not None
    weights = {t.key for t in frozen.weights}

    def stored(key: str) -> str:
        """The "stored in" cell (none without a base): here or in the base, trainable or frozen."""
        if not with_base:
            return ""
        where = f"base {base_name}" if key in frozen.base_keys else "this checkpoint"
        trains = ""
        if frozen.trainable is not None and key in weights:
            trains = " (trainable)" if key in frozen.trainable else " (frozen)"
        return f"<td>{esc(where + trains)}</td>"

    rows = "".join(
        f'<tr data-key="{esc(t.key)}"><td class=key>{esc(t.key)}</td><td>{esc(t.group)}</td>'
        f"<td>{esc(t.dtype or 'object')}</td><td>{esc('x'.join(map(str, t.shape)) if t.shape else '-')}</td>"
        f"<td class=num>{esc(human_bytes(t.bytes))}</td><td class=num>{t.chunks}</td>"
        f"<td>{esc(compact_ranges(sorted(writers[t.key])))}</td>{stored(t.key)}</tr>"
        for t in layout.info.tensors
    )
    head = (
        "<tr><th>key</th><th>group</th><th>dtype</th><th>shape</th><th>size</th><th>chunks</th>"
        f"<th>written by ranks</th>{'<th>stored in</th>' if with_base else ''}</tr>"
    )
    return [f"<h2>every entry ({len(layout.info.tensors)})</h2>", f'<table id="entries">{head}{rows}</table>']
