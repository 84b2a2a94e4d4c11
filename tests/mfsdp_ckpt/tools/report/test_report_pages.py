"""The pages people look at (issue 51, item 13): ``inspect --html`` shows a transformers checkpoint's
model as a short table (family, architecture, layers, hidden, experts, parameters by kind) with the
raw config once and folded; ``diff --html`` of 400 differing tensors has counts on every histogram
bin, bin labels that do not overlap, a summary by kind and by layer, and a table that sorts by a
column and filters, checked in a headless Chromium at 1,400 px wide."""

from __future__ import annotations

import html
import json
import math
import re
import subprocess

import pytest
import torch
import torch.distributed.checkpoint as dcp

from mfsdp_ckpt.tools.diff import HISTOGRAM_BINS
from mfsdp_ckpt.tools.inspect import inspect_checkpoint
from mfsdp_ckpt.tools.report.browser import browser_args
from mfsdp_ckpt.tools.report.kinds import layer_of, param_kind
from mfsdp_ckpt.tools.report.svg import short_count
from tests.hf_models import make_hf_dir
from tests.mfsdp_ckpt.tools.report.test_report import _browser, cli
from tests.torchrun import failure, run_train

#: the parameters of each layer of the diff checkpoints, one per kind the page sorts them into
LAYER_PARAMS = {
    "self_attention.linear_qkv.weight": "attention",
    "self_attention.linear_proj.weight": "attention",
    "mlp.linear_fc1.weight": "MLP",
    "mlp.linear_fc2.weight": "MLP",
    "input_layernorm.weight": "norms",
    "pre_mlp_layernorm.weight": "norms",
    "mlp.router.weight": "experts",
    "mlp.experts.linear_fc1.weight0": "experts",
}
LAYERS = 50  # 50 x 8 = 400 differing tensors


def _dom_after(browser: str, page_path: str, script: str, tmp_path, name: str) -> dict:
    """Run ``script`` in the rendered page (1,400 px wide) and return what it left as JSON in
    ``#test-result``: the page as written, its CSP loosened only to let the test's script run."""
    text = open(page_path, encoding="utf-8").read()
    text = re.sub(r'<meta http-equiv="Content-Security-Policy"[^>]*>', "", text)
    text = text.replace("</body>", f"<script>{script}</script></body>")
    page = tmp_path / f"{name}.html"
    page.write_text(text, encoding="utf-8")
    dom = subprocess.run(
        [
            *browser_args(browser),
            f"--user-data-dir={tmp_path / ('profile-' + name)}",
            "--window-size=1400,2000",
            "--dump-dom",
            f"file://{page}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    found = re.search(r'<pre id="test-result">(.*?)</pre>', dom, re.S)
    assert found, dom[-2000:]
    return json.loads(html.unescape(found.group(1)))


# --- inspect --html of a transformers checkpoint ---------------------------------------------


@pytest.fixture(scope="module")
def hf_checkpoints(tmp_path_factory) -> dict[str, str]:
    """A Mixtral checkpoint trained with ``--hf-model`` (1 process, 1 step) and one from ``import-hf``."""
    d = tmp_path_factory.mktemp("hf_pages")
    hf_dir = make_hf_dir(d / "hf", "mixtral")
    run = run_train(None, "--hf-model", hf_dir, "--steps", "1", "--save-every", "1", "--ckpt-dir", str(d / "run"))
    assert run.returncode == 0, failure(run)
    imported = cli("import-hf", hf_dir, str(d / "imported"))
    assert imported.returncode == 0, imported.stderr
    return {"trained": str(d / "run" / "step_000001"), "imported": str(d / "imported")}


def _facts(text: str) -> dict[str, str]:
    table = re.search(r'<table class="model">(.*?)</table>', text, re.S)
    assert table, "no model table"
    return dict(re.findall(r"<tr><th>([^<]*)</th><td>([^<]*)</td></tr>", table.group(1)))


def _kinds(text: str) -> dict[str, tuple[int, int]]:
    table = re.search(r'<table class="kinds">(.*?)</table>', text, re.S)
    assert table, "no parameters-by-kind table"
    rows = re.findall(
        r'<tr data-kind="([^"]+)"><td>[^<]*</td><td class=num>(\d+)</td><td class=num>([\d,]+)</td>', text
    )
    return {k: (int(n), int(p.replace(",", ""))) for k, n, p in rows}


@pytest.mark.parametrize("which", ["trained", "imported"])
def test_inspect_page_shows_a_transformers_model_as_a_table(hf_checkpoints, which, tmp_path):
    out = tmp_path / "page.html"
    run = cli("inspect", hf_checkpoints[which], "--html", str(out))
    assert run.returncode == 0, run.stderr
    info = inspect_checkpoint(hf_checkpoints[which])
    text = out.read_text()
    facts = _facts(text)
    assert facts["family"] == "mixtral" and facts["layers"] == "2" and facts["hidden size"].startswith("32")
    assert facts["experts"].startswith("4, top 2 per token")
    if which == "trained":
        assert facts["architecture"] == "MixtralForCausalLM"
    summary = re.search(r'<table class="summary">(.*?)</table>', text, re.S).group(1)
    model = re.search(r"<th>model</th><td><code>([^<]*)</code>", summary).group(1)
    assert model.startswith("mixtral · ") and "unknown" not in model
    # parameters by kind add up to every model.* tensor's elements, and name the MoE's parts
    kinds = _kinds(text)
    weights = [t for t in info.tensors if t.group == "model"]
    assert sum(p for _, p in kinds.values()) == sum(math.prod(t.shape) for t in weights)
    assert sum(n for n, _ in kinds.values()) == len(weights)
    assert {"embeddings", "attention", "experts", "norms"} <= set(kinds)
    assert f"{sum(p for _, p in kinds.values()):,} in {len(weights)} tensors" in facts["parameters"]
    # the raw config: once, and folded away
    name = "num_hidden_layers" if which == "trained" else "num_layers"  # transformers' / our GPTConfig's
    assert text.count(f"&quot;{name}&quot;") == 1
    folded = re.search(r'<details class="raw-config">(.*?)</details>', text, re.S)
    assert folded and f"&quot;{name}&quot;: 2" in folded.group(1)
    assert '<details class="raw-config" open' not in text


def test_inspect_page_model_table_renders_at_1400px(hf_checkpoints, tmp_path):
    browser = _browser()
    out = tmp_path / "page.html"
    assert cli("inspect", hf_checkpoints["trained"], "--html", str(out)).returncode == 0
    got = _dom_after(
        browser,
        str(out),
        """
        var d = document.querySelector('details.raw-config');
        var pre = d.querySelector('pre');
        var model = document.querySelector('table.model').getBoundingClientRect();
        var kinds = document.querySelector('table.kinds').getBoundingClientRect();
        var r = {closed: !d.open, raw_height: d.getBoundingClientRect().height, raw_shown: pre.checkVisibility(),
                 model_right: model.right, kinds_left: kinds.left, kinds_right: kinds.right,
                 width: document.documentElement.scrollWidth};
        d.open = true;
        r.raw_height_open = d.getBoundingClientRect().height; r.raw_shown_open = pre.checkVisibility();
        var out = document.createElement('pre'); out.id = 'test-result'; out.textContent = JSON.stringify(r);
        document.body.appendChild(out);
        """,
        tmp_path,
        "inspect",
    )
    # folded: one line (its summary) until opened, the JSON hidden
    assert got["closed"] and not got["raw_shown"] and got["raw_height"] < 30, got
    assert got["raw_shown_open"] and got["raw_height_open"] > 100, got
    # the two tables side by side, inside the 1,400 px window
    assert got["model_right"] <= got["kinds_left"] and got["kinds_right"] <= 1400 and got["width"] <= 1400


# --- diff --html of 400 differing tensors ----------------------------------------------------


@pytest.fixture(scope="module")
def diff_400(tmp_path_factory) -> tuple[str, dict]:
    """``diff --html --json`` of two checkpoints whose 400 layer tensors all differ (by 1e-9 to
    1e0, by layer), with one key only in A; returns the page and the JSON."""
    d = tmp_path_factory.mktemp("diff400")
    g = torch.Generator().manual_seed(0)
    a, b = {}, {}
    for layer in range(LAYERS):
        for i, name in enumerate(LAYER_PARAMS):
            key = f"model.decoder.layers.{layer}.{name}"
            a[key] = torch.randn(16, 8, generator=g, dtype=torch.float64)
            b[key] = a[key] + torch.randn(16, 8, generator=g, dtype=torch.float64) * 10.0 ** (-(layer % 9) - i % 3)
    a["model.embedding.word_embeddings.weight"] = b["model.embedding.word_embeddings.weight"] = torch.ones(8, 8)
    a["model.output_layer.weight"] = torch.ones(4, 8)
    dcp.save(a, checkpoint_id=str(d / "a"), no_dist=True)
    dcp.save(b, checkpoint_id=str(d / "b"), no_dist=True)
    out = d / "diff.html"
    run = cli("diff", str(d / "a"), str(d / "b"), "--html", str(out), "--json")
    assert run.returncode == 1, run.stderr
    return str(out), json.loads(run.stdout)


def test_kinds_and_layers_of_names():
    for name, kind in LAYER_PARAMS.items():
        assert param_kind(f"model.decoder.layers.7.{name}") == kind
        assert param_kind(f"optim.decoder.layers.7.{name}.exp_avg") == kind
        assert layer_of(f"optim.decoder.layers.7.{name}.exp_avg") == 7
    hf = {
        "model.model.embed_tokens.weight": "embeddings",
        "model.lm_head.weight": "embeddings",
        "model.model.layers.1.self_attn.q_proj.weight": "attention",
        "model.model.layers.1.self_attn.q_norm.weight": "norms",
        "model.model.layers.1.mlp.gate_proj.weight": "MLP",
        "model.model.layers.1.mlp.gate.weight": "experts",
        "model.model.layers.1.mlp.experts.gate_up_proj": "experts",
        "model.model.layers.1.block_sparse_moe.experts.0.w1.weight": "experts",
        "model.model.norm.weight": "norms",
        "model.decoder.layers.0.self_attention.linear_qkv.layer_norm_weight": "norms",
        "extra.trainer": "other",
    }
    assert {k: param_kind(k) for k in hf} == hf
    assert layer_of("model.model.norm.weight") is None and layer_of("model.model.layers.12.mlp.up_proj") == 12


def test_diff_page_summarises_400_rows_by_kind_and_layer(diff_400):
    page_path, result = diff_400
    text = open(page_path, encoding="utf-8").read()
    assert len(result["different"]) == 400 and result["only_in_a"] == ["model.output_layer.weight"]
    rows = re.findall(r'<tr class="differs" data-key="([^"]+)"', text)
    assert len(rows) == 401
    by_kind = re.search(r'<table id="by-kind">(.*?)</table>', text, re.S).group(1)
    for kind in ("attention", "MLP", "norms", "experts"):
        assert re.search(rf'data-set-kind="{kind}"[^>]*><td>{kind}</td><td class=num>100</td>', by_kind), kind
    assert re.search(
        r'data-set-kind="embeddings"[^>]*><td>embeddings</td><td class=num>0</td><td class=num>1</td>', by_kind
    )
    matrix = re.search(r'<table id="by-layer" class="matrix">(.*?)</table>', text, re.S).group(1)
    cells = re.findall(r'data-set-kind="([^"]+)" data-set-layer="([^"]+)"[^>]*>(\d+)</td>', matrix)
    assert len(cells) == 4 * LAYERS + 1 and all(n == "2" for k, _, n in cells if k != "embeddings")
    # the histogram of every element: a count over each non-empty bin, equal to the sum of the rows'
    overall = re.search(r'<div id="overall">(.*?)</div>', text, re.S).group(1)
    total = [sum(col) for col in zip(*(d["histogram"] for d in result["different"]))]
    counts = re.findall(r'<text class="count"[^>]*>([^<]+)</text>', overall)
    assert counts == [short_count(n) for n in total if n]
    assert [html.unescape(x) for x in re.findall(r'<text class="bin"[^>]*>([^<]+)</text>', overall)] == [
        b.replace("<=", "≤") for b in HISTOGRAM_BINS
    ]


SORT_AND_FILTER = """
var table = document.getElementById('entries');
function col(name) {
  return Array.prototype.slice.call(table.tHead.rows[0].cells).filter(function (th) {
    return th.textContent === name; })[0];
}
function values(th) {
  return Array.prototype.slice.call(table.tBodies[0].rows).map(function (r) {
    var c = r.cells[th.cellIndex]; return c.hasAttribute('data-v') ? c.getAttribute('data-v') : c.textContent; });
}
var r = {};
function box(el) { var b = el.getBoundingClientRect(); return [b.left, b.top, b.right, b.bottom]; }
r.hists = Array.prototype.slice.call(document.querySelectorAll('svg.hist')).map(function (svg) {
  return {bins: Array.prototype.slice.call(svg.querySelectorAll('text.bin')).map(box),
          counts: Array.prototype.slice.call(svg.querySelectorAll('text.count')).map(box),
          bars: Array.prototype.slice.call(svg.querySelectorAll('rect')).filter(function (b) {
            return parseFloat(b.getAttribute('height')) > 0; }).length};
});
var maxAbs = col('max |Δ|');
maxAbs.click(); r.up = values(maxAbs); r.up_mark = maxAbs.getAttribute('aria-sort');
maxAbs.click(); r.down = values(maxAbs); r.down_mark = maxAbs.getAttribute('aria-sort');
var key = col('key'); key.click(); r.keys = values(key);
var kind = document.querySelector('select[data-filter="kind"]');
var layer = document.querySelector('select[data-filter="layer"]');
kind.value = 'attention'; kind.dispatchEvent(new Event('change'));
layer.value = '3'; layer.dispatchEvent(new Event('change'));
r.shown = Array.prototype.slice.call(table.tBodies[0].rows).filter(function (tr) {
  return !tr.classList.contains('hidden'); }).map(function (tr) { return tr.getAttribute('data-key'); });
r.matches = document.getElementById('matches').textContent;
document.querySelector('#by-layer td[data-set-kind="norms"][data-set-layer="7"]').click();
r.picked = Array.prototype.slice.call(table.tBodies[0].rows).filter(function (tr) {
  return !tr.classList.contains('hidden'); }).map(function (tr) { return tr.getAttribute('data-key'); });
r.picked_selects = [kind.value, layer.value];
var out = document.createElement('pre'); out.id = 'test-result'; out.textContent = JSON.stringify(r);
document.body.appendChild(out);
"""


def _overlap(a: list[float], b: list[float]) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def test_diff_page_sorts_filters_and_labels_without_overlap_in_chromium(diff_400, tmp_path):
    browser = _browser()
    page_path, result = diff_400
    got = _dom_after(browser, page_path, SORT_AND_FILTER, tmp_path, "diff")
    up = [float(v) for v in got["up"]]
    assert up == sorted(up) and got["up_mark"] == "ascending" and up[0] == -math.inf  # the one-sided row first
    down = [float(v) for v in got["down"]]
    assert down == sorted(down, reverse=True) and got["down_mark"] == "descending"
    assert down[0] == max(d["max_abs"] for d in result["different"])
    assert got["keys"] == sorted(got["keys"], key=str.lower) and len(got["keys"]) == 401
    assert got["shown"] == [
        "model.decoder.layers.3.self_attention.linear_proj.weight",
        "model.decoder.layers.3.self_attention.linear_qkv.weight",
    ]
    assert got["matches"] == "2 matching rows"
    assert got["picked_selects"] == ["norms", "7"]
    assert sorted(got["picked"]) == [
        "model.decoder.layers.7.input_layernorm.weight",
        "model.decoder.layers.7.pre_mlp_layernorm.weight",
    ]
    # every histogram (the overall one and the 400 rows'): a count for each bar, no two labels overlapping
    hists = got["hists"]
    assert len(hists) == 401
    for h in hists:
        assert len(h["counts"]) == h["bars"]
        labels = h["bins"] + h["counts"]
        assert h["bins"] and all(box[2] > box[0] and box[3] > box[1] for box in labels)  # drawn, not hidden
        for i, a in enumerate(labels):
            for b in labels[i + 1 :]:
                assert not _overlap(a, b), (a, b)
