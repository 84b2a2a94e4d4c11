"""``diff --html`` keeps the parts of the training state apart: comparing two checkpoints of one
run (steps 30 and 60), the summary by kind gives the weights' largest |Δ| (and ‖Δ‖/‖B‖), each
optimizer state's (``exp_avg``, ``exp_avg_sq``, ``main_param``) and the MXFP8 planes' in columns
of their own, and Adam's ``step`` counters (and ``extra.step``) as counters, ``step: 30 → 60
(+30)``, never inside a tensor maximum; a copy compares "equal" in every cell. The checkpoints are
written in-process (``dcp.save``) with the key names of a tiny-moe run with MXFP8 weights; the
page is checked as HTML, and its summary's width in a headless Chromium at the --png width."""

from __future__ import annotations

import html
import math
import re
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

from mfsdp_ckpt.tools.diff import diff_checkpoints
from mfsdp_ckpt.tools.report.diff_page import diff_html
from tests.mfsdp_ckpt.tools.report.test_report import _browser
from tests.mfsdp_ckpt.tools.report.test_report_pages import _dom_after

#: parameter -> (shape, the kind the page files it under): attention, a dense MLP, a shared and a
#: routed expert, a norm, the embeddings (tiny-moe's names)
PARAMS = {
    "decoder.layers.0.self_attention.linear_qkv.weight": ((32, 16), "attention"),
    "decoder.layers.0.self_attention.linear_proj.weight": ((16, 16), "attention"),
    "decoder.layers.0.mlp.shared_experts.linear_fc1.weight": ((32, 16), "experts"),
    "decoder.layers.0.mlp.experts.linear_fc1.weight0": ((32, 16), "experts"),
    "decoder.layers.0.pre_mlp_layernorm.weight": ((16,), "norms"),
    "decoder.layers.1.self_attention.linear_qkv.weight": ((32, 16), "attention"),
    "decoder.layers.1.mlp.linear_fc1.weight": ((32, 16), "MLP"),
    "embedding.word_embeddings.weight": ((64, 16), "embeddings"),
}
#: the MXFP8 weights (their planes: rowwise and columnwise data and scales)
MX = ("decoder.layers.0.self_attention.linear_qkv.weight", "decoder.layers.1.mlp.linear_fc1.weight")
#: how far each part moves between the two steps (the step counters move by 30)
MOVES = {"weights": 1e-2, "main_param": 1e-2, "exp_avg": 1e-3, "exp_avg_sq": 1e-7}


def _state(step: int, g: torch.Generator, base: dict | None = None) -> dict:
    """A training state at ``step``: ``base`` moved by :data:`MOVES` (or fresh when None)."""
    out: dict = {}
    for name, (shape, _) in PARAMS.items():
        parts = {
            f"model.{name}": "weights",
            f"optim.{name}.main_param": "main_param",
            f"optim.{name}.exp_avg": "exp_avg",
            f"optim.{name}.exp_avg_sq": "exp_avg_sq",
        }
        for key, part in parts.items():
            fresh = torch.randn(shape, generator=g).abs() * (0.1 if part != "exp_avg_sq" else 1e-6)
            out[key] = fresh if base is None else base[key] + MOVES[part] * torch.rand(shape, generator=g)
        out[f"optim.{name}.step"] = torch.tensor(float(step))
    for name in MX:
        rows, cols = PARAMS[name][0]
        w = out[f"model.{name}"] * (1.0 if base is None else 40.0)  # the fp8 codes move far more than the weights
        for direction, blocks in (("rowwise", (rows, cols // 16)), ("columnwise", (rows // 16, cols))):
            out[f"mx.{name}.{direction}_data"] = (w * 100).to(torch.float8_e4m3fn)
            out[f"mx.{name}.{direction}_scale"] = torch.full(blocks, 2.0**-6).to(torch.float8_e8m0fnu)
    out["extra.step"] = step
    out["optim.param_groups"] = [{"lr": 1e-3 * step, "params": list(PARAMS)}]
    return out


@pytest.fixture(scope="module")
def run_pages(tmp_path_factory) -> dict:
    """Steps 30 and 60 of one run, a copy of step 60; the pages of 30 vs 60 and of 60 vs its copy."""
    d = tmp_path_factory.mktemp("parts")
    g = torch.Generator().manual_seed(0)
    a = _state(30, g)
    b = _state(60, g, a)
    dcp.save(a, checkpoint_id=str(d / "step_30"), no_dist=True)
    dcp.save(b, checkpoint_id=str(d / "step_60"), no_dist=True)
    shutil.copytree(d / "step_60", d / "copy")
    out = {"a": a, "b": b}
    for name, (x, y) in {"run": ("step_30", "step_60"), "copy": ("step_60", "copy")}.items():
        result = diff_checkpoints(d / x, d / y)
        out[name] = open(diff_html(d / x, d / y, result, d / f"{name}.html"), encoding="utf-8").read()
        out[f"{name}_path"] = str(d / f"{name}.html")
        out[f"{name}_result"] = result
    return out


def _cells(text: str) -> dict[str, dict[str, str]]:
    """kind -> part -> the cell's text: its largest max |Δ| (``data-max``), ``equal`` or ``''``."""
    found = re.search(r'<table id="by-kind">(.*?)</table>', text, re.S)
    assert found, "no summary by kind"
    heads = re.findall(r"<tr>(<th.*?)</tr>", found.group(1), re.S)
    assert len(heads) == 2, "the summary by kind has no column per part of the state (weights, exp_avg, ...)"
    table, (top, bottom) = found.group(1), heads
    below = iter(re.findall(r'data-part="([^"]+)"', bottom))
    parts = []  # in column order: a part heading its column alone, or a group's parts from the row below
    for attrs in re.findall(r"<th([^>]*)>", top)[5:]:
        if (alone := re.search(r'data-part="([^"]+)"', attrs)) is not None:
            parts.append(alone.group(1))
        elif (span := re.search(r"colspan=(\d+)", attrs)) is not None:
            parts += [next(below) for _ in range(int(span.group(1)))]
    out = {}
    for row in re.findall(r'<tr [^>]*class="pick[^"]*">(.*?)</tr>', table, re.S):
        tds = re.findall(r"<td([^>]*)>(.*?)</td>", row, re.S)
        kind = tds[0][1]
        part_cells = tds[5 : 5 + len(parts)]
        values = {}
        for part, (attrs, body) in zip(parts, part_cells):
            found = re.search(r'data-max="([^"]*)"', attrs)
            values[part] = found.group(1) if found else html.unescape(re.sub(r"<[^>]+>", "", body))
        values["counters"] = html.unescape(re.sub(r"<br>", "\n", tds[5 + len(parts)][1]))
        out[kind] = values
    return out


def _part(key: str) -> str:
    """The part of the state a key of :func:`_state` is (the page's columns)."""
    if key.startswith("model."):
        return "weights"
    if key.startswith("mx."):
        return "mx " + key.rsplit("_", 1)[1]
    return key.rsplit(".", 1)[1]


def _kind(key: str) -> str:
    """The kind of the parameter a key of :func:`_state` belongs to."""
    return next(kind for name, (_, kind) in PARAMS.items() if f".{name}." in f"{key}.")


def _largest(state_a: dict, state_b: dict, kind: str, part: str) -> float:
    """The largest |a - b| over the tensors of ``kind`` and ``part`` (the expected cell)."""
    return max(
        float((state_a[k].double() - state_b[k].double()).abs().max())
        for k in state_a
        if isinstance(state_a[k], torch.Tensor) and _kind(k) == kind and _part(k) == part
    )


def test_summary_by_kind_keeps_weights_moments_planes_and_counters_apart(run_pages):
    cells = _cells(run_pages["run"])
    a, b = run_pages["a"], run_pages["b"]
    assert {"attention", "MLP", "experts", "norms", "embeddings", "other", "all"} <= set(cells)
    for kind in ("attention", "MLP", "experts", "norms", "embeddings"):
        for part in ("weights", "main_param", "exp_avg", "exp_avg_sq"):
            got = float(cells[kind][part])
            assert got == pytest.approx(_largest(a, b, kind, part), rel=1e-3), (kind, part)
            assert got <= MOVES[part], (kind, part, got)  # no step counter (30) in a tensor maximum
        assert cells[kind]["counters"] == "step: 30 → 60 (+30)", kind
    # the weights' column, the moments' and the MXFP8 planes': each its own scale, none of them 30
    every = cells["all"]
    assert float(every["weights"]) <= 1e-2 and float(every["exp_avg_sq"]) <= 1e-7
    assert float(every["mx data"]) > 1 and float(every["mx data"]) == pytest.approx(
        max(_largest(a, b, k, "mx data") for k in ("attention", "MLP")), rel=1e-3
    )
    assert every["mx scale"] == "equal"  # the scales did not move
    assert "extra.step: 30 → 60 (+30)" in cells["other"]["counters"]
    assert all(v != "30" for kind in cells.values() for p, v in kind.items() if p != "counters")


def test_counters_are_listed_apart_and_the_table_calls_them_counters(run_pages):
    text = run_pages["run"]
    table = re.search(r'<table id="counters">(.*?)</table>', text, re.S)
    assert table, "no table of counters"
    rows = re.findall(
        r'<tr class="(counter|object)"><td><code>([^<]*)</code></td><td class=num>(\d+)</td><td>([^<]*)</td>',
        table.group(1),
    )
    rows = [(cls, key, int(n), html.unescape(change)) for cls, key, n, change in rows]
    assert ("counter", "optim.*.step", len(PARAMS), "30 → 60 (+30)") in rows
    assert ("counter", "extra.step", 1, "30 → 60 (+30)") in rows
    assert [r[1] for r in rows if r[0] == "object"] == ["optim.param_groups"]
    # the table of differences: every step counter is a "counter" without a max |Δ|
    for key in (f"optim.{name}.step" for name in PARAMS):
        row = re.search(
            rf'<tr class="differs" data-key="{re.escape(key)}"[^>]*data-problem="([^"]+)">(.*?)</tr>', text, re.S
        )
        assert row and row.group(1) == "counter", key
        assert '<td class=num data-v="-Infinity">-</td>' in row.group(2) and "step: 30 → 60 (+30)" in html.unescape(
            row.group(2)
        )
    # one histogram per part, none for the counters
    overall = re.search(r'<div id="overall">(.*?)</div>', text, re.S).group(1)
    assert re.findall(r'<tr data-part="([^"]+)">', overall) == [
        "weights",
        "main_param",
        "exp_avg",
        "exp_avg_sq",
        "mx data",
    ]


def test_a_copy_is_equal_in_every_cell(run_pages):
    assert run_pages["copy_result"].equal
    cells = _cells(run_pages["copy"])
    for kind in ("attention", "MLP", "experts", "norms", "embeddings", "all"):
        for part in ("weights", "main_param", "exp_avg", "exp_avg_sq", "counters"):
            assert cells[kind][part] == "equal", (kind, part)
    # every cell of a kind with such tensors says so; the others are blank
    assert {v for parts in cells.values() for v in parts.values()} <= {"equal", ""}
    assert cells["attention"]["mx data"] == cells["MLP"]["mx scale"] == "equal" and cells["norms"]["mx data"] == ""
    assert "diff: equal" in run_pages["copy"] and 'id="counters"' not in run_pages["copy"]


def test_summary_fits_the_screenshot_width_in_chromium(run_pages, tmp_path):
    browser = _browser()
    got = _dom_after(
        browser,
        run_pages["run_path"],
        """
        var t = document.getElementById('by-kind');
        var r = {right: t.getBoundingClientRect().right, overflow: []};
        t.querySelectorAll('td').forEach(function (td) {
          if (td.scrollWidth > td.clientWidth + 1) { r.overflow.push(td.textContent); }
        });
        var out = document.createElement('pre'); out.id = 'test-result'; out.textContent = JSON.stringify(r);
        document.body.appendChild(out);
        """,
        tmp_path,
        "parts",
    )
    assert got["right"] <= 1280 and not got["overflow"], got
    assert not math.isnan(got["right"])
