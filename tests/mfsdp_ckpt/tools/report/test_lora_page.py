"""The pages of a LoRA fine-tune: ``inspect --html`` says it is one (r, alpha, targets), lists the
adapter tensors per target (modules, layers, factor shapes, count, parameters, bytes), the frozen
weights read from the base the save references (its name, the reference checked) and trainable
against frozen parameters; ``diff --html`` of two of its saves finds the frozen weights equal and
the adapters and their Adam moments changed, the step counters apart. One trainer run (one
process, a tiny transformers Llama, 2 steps, a save after each) makes the checkpoints."""

from __future__ import annotations

import html
import json
import math
import re

import pytest

from mfsdp_ckpt.tools.diff import diff_checkpoints
from mfsdp_ckpt.tools.inspect import inspect_checkpoint
from mfsdp_ckpt.tools.report.diff_page import diff_html
from mfsdp_ckpt.tools.report.inspect_page import inspect_html
from tests.hf_models import make_hf_dir
from tests.mfsdp_ckpt.tools.report.test_diff_page_parts import _cells
from tests.torchrun import failure, run_train

TARGETS = ("q_proj", "v_proj")
BASE = "base_step_000001"  # the first save writes the frozen weights once, the second references them


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> dict:
    """A 2-step LoRA run of a tiny Llama saved after each step; the pages of its last save, of its
    base, and of the diff of its two saves."""
    d = tmp_path_factory.mktemp("lora_page")
    hf = make_hf_dir(d / "llama", "llama")
    run = run_train(
        None,
        *("--hf-model", hf, "--lora", f"r=4,alpha=8,targets={','.join(TARGETS)}"),
        *("--steps", "2", "--batch-size", "2", "--seq-len", "8", "--save-every", "1", "--ckpt-dir", str(d / "run")),
    )
    assert run.returncode == 0, failure(run)
    first, last, base = (str(d / "run" / n) for n in ("step_000001", "step_000002", BASE))
    with open(f"{base}/mfsdp.json", encoding="utf-8") as f:
        base_keys = set(json.load(f)["index"]["keys"])
    with open(f"{last}/mfsdp.json", encoding="utf-8") as f:
        reference = json.load(f)["base"]
    pages = {
        "last": inspect_html(last, d / "last.html"),
        "base": inspect_html(base, d / "base.html"),
        "diff": diff_html(first, last, diff_checkpoints(first, last), d / "diff.html"),
    }
    out = {name: open(p, encoding="utf-8").read() for name, p in pages.items()}
    return {**out, "info": inspect_checkpoint(last), "base_keys": base_keys, "reference": reference}


def _rows(text: str, table_class: str) -> dict[str, tuple[str, str]]:
    """label -> (value, tooltip) of a two-column table of facts."""
    table = re.search(rf'<table class="{table_class}">(.*?)</table>', text, re.S)
    assert table, f"no table of class {table_class}"
    found = re.findall(r'<tr(?: title="([^"]*)")?><th>([^<]*)</th><td>(?:<code>)?([^<]*)', table.group(1))
    return {label: (html.unescape(value), html.unescape(tip)) for tip, label, value in found}


def _params(info, keys) -> int:
    return sum(math.prod(t.shape) for t in info.tensors if t.key in keys)


def test_inspect_page_says_lora_with_its_rank_targets_and_trainable_parameters(lora_run):
    text, info = lora_run["last"], lora_run["info"]
    weights = {t.key for t in info.tensors if t.group == "model"}
    adapters = {k for k in weights if ".lora_A." in k or ".lora_B." in k}
    trainable, every = _params(info, adapters), _params(info, weights)
    assert len(adapters) == 8 and lora_run["base_keys"] == weights - adapters
    summary = _rows(text, "summary")
    assert summary["LoRA"][0] == (
        f"fine-tune: r=4, alpha 8 on q_proj, v_proj; {trainable:,} of {every:,} parameters train "
        f"({100 * trainable / every:.1f}%)"
    )
    assert summary["base"][0] == f"{BASE}: {len(weights) - 8} frozen weights read from there (reference checked)"
    assert '<h2 id="lora">LoRA fine-tune</h2>' in text
    facts = _rows(text, "lora")
    assert facts["adapters"][0] == "LoRA rank r=4, alpha 8 (scale alpha / r = 2), dropout 0"
    assert facts["targets"][0] == "q_proj, v_proj"
    assert facts["trainable"][0].startswith(f"{trainable:,} parameters in 8 tensors (")
    assert facts["trainable"][0].endswith(": the adapters")
    frozen = f"{every - trainable:,} parameters in {len(weights) - 8} tensors ("
    assert facts["frozen"][0].startswith(frozen) and facts["frozen"][0].endswith(f"all read from {BASE}")
    assert facts["checked"][0].startswith("every lora_A has its lora_B and its base weight")


def test_inspect_page_lists_the_adapters_per_target(lora_run):
    text, info = lora_run["last"], lora_run["info"]
    table = re.search(r'<table class="adapters">(.*?)</table>', text, re.S)
    assert table, "no table of adapters per target"
    rows = re.findall(r'<tr data-target="([^"]+)">(.*?)</tr>', table.group(1), re.S)
    assert [t for t, _ in rows] == list(TARGETS)
    for target, row in rows:
        cells = [html.unescape(c) for c in re.findall(r"<td[^>]*>(?:<code>)?([^<]*)", row)]
        tensors = [t for t in info.tensors if f".{target}.lora_" in t.key and t.group == "model"]
        a = next(t for t in tensors if ".lora_A." in t.key)
        b = next(t for t in tensors if ".lora_B." in t.key)
        assert cells[:5] == [target, "2", "0-1", "x".join(map(str, a.shape)), "x".join(map(str, b.shape))], cells
        assert cells[5:7] == [str(len(tensors)), f"{sum(math.prod(t.shape) for t in tensors):,}"], cells


def test_inspect_page_names_the_frozen_weights_read_from_the_base(lora_run):
    text = lora_run["last"]
    facts = _rows(text, "lora")
    value, tip = facts["base"]
    assert value.startswith(f"{BASE}: a sibling checkpoint") and "Reference checked" in value
    ref = lora_run["reference"]
    assert ref["save_id"] in tip and str(ref["manifest_crc32c"]) in tip and ref["id"] in tip
    listed = re.search(r'<details class="raw-config" data-list="from-base">(.*?)</details>', text, re.S)
    assert listed, "no list of the entries read from the base"
    assert set(re.findall(r'<tr data-key="([^"]+)">', listed.group(1))) == lora_run["base_keys"]
    entries = re.search(r'<table id="entries">(.*?)</table>', text, re.S).group(1)
    where = dict(re.findall(r'<tr data-key="([^"]+)">.*?<td>([^<]*)</td></tr>', entries))
    for key in lora_run["base_keys"]:
        assert where[key] == f"base {BASE} (frozen)", key
    assert where["model.model.layers.0.self_attn.q_proj.lora_A.weight"] == "this checkpoint (trainable)"
    assert f"<code>{BASE}/__0_0.distcp</code>" in text and "&lt;base:" not in text  # files under the base's name


def test_the_base_itself_says_it_is_one(lora_run):
    summary = _rows(lora_run["base"], "summary")
    assert summary["role"][0].startswith("a base: the frozen weights of a run, written once")
    assert "checked" not in _rows(lora_run["base"], "lora")  # a base holds no adapters to check


def test_diff_of_two_saves_finds_the_frozen_weights_equal_and_the_adapters_moved(lora_run):
    cells = _cells(lora_run["diff"])
    for kind in ("embeddings", "attention", "MLP", "norms"):
        assert cells[kind]["weights"] == "equal", kind
    adapters = cells["LoRA adapters"]
    assert 0 < float(adapters["weights"]) < 1 and 0 < float(adapters["exp_avg"]) < 1
    assert adapters["counters"] == "step: 1 → 2 (+1)"
