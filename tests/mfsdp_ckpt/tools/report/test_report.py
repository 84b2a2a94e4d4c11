"""``inspect --html`` / ``--png``: the page of a real 3-rank EP + MXFP8 checkpoint, escaping of
untrusted names, bad input, an SVG snapshot, and rendering in a headless Chromium."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

from mfsdp_ckpt.tools.diff import HISTOGRAM_BINS
from mfsdp_ckpt.tools.report.browser import BROWSERS, browser_args
from mfsdp_ckpt.tools.report.layout import checkpoint_layout
from mfsdp_ckpt.tools.report.svg import rank_color, rank_strips
from tests.torchrun import ENV, ROOT, failure, run_train

pytestmark = pytest.mark.heavy  # slow (the inner loop's 8 minutes); CI runs it

SNAPSHOT = os.path.join(os.path.dirname(__file__), "snapshots", "strips_model.svg")
EVIL = "<img src=x onerror=alert(1)>"
MOE6 = {
    "vocab_size": 256,
    "hidden_size": 64,
    "num_layers": 2,
    "num_attention_heads": 4,
    "num_query_groups": 2,
    "kv_channels": 16,
    "ffn_hidden_size": 128,
    "seq_length": 128,
    "num_experts": 6,
    "moe_router_topk": 2,
    "moe_ffn_hidden_size": 64,
}


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cli.main", *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300
    )


@pytest.fixture(scope="module")
def ep_mx_ckpt(tmp_path_factory) -> str:
    """A checkpoint of 3 ranks, EP 3 (6 experts), MXFP8 weights, written by the trainer."""
    d = tmp_path_factory.mktemp("ep_mx")
    config = d / "moe6.json"
    config.write_text(json.dumps(MOE6))
    run = run_train(
        3,
        "--model-config",
        str(config),
        "--ep",
        "3",
        "--mxfp8",
        "--steps",
        "2",
        "--save-every",
        "2",
        "--ckpt-dir",
        str(d / "run"),
    )
    assert run.returncode == 0, failure(run)
    return str(d / "run" / "step_000002")


def _browser() -> str:
    for name in BROWSERS:
        if shutil.which(name):
            return shutil.which(name)
    pytest.skip(f"no headless browser ({', '.join(BROWSERS)}) on PATH: make test installs chromium where it can")


def test_page_has_a_strip_per_rank_and_the_ep_and_mx_layout(ep_mx_ckpt, tmp_path):
    out = tmp_path / "page.html"
    run = cli("inspect", ep_mx_ckpt, "--html", str(out))
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == f"wrote {out}"
    text = out.read_text()
    for group in ("model", "optim", "mx", "extra"):
        strips = re.search(rf'<svg class="strips" data-group="{group}".*?</svg>', text)
        assert strips, group
        assert re.findall(r'<g class="strip" data-rank="(\d+)"', strips.group(0)) == ["0", "1", "2"], group
    assert "rank 2 · EP 2" in text and "EP size 3, 6 experts" in text
    assert text.count('class="mx-block"') > 0  # 32-row block boundaries on the 128-row MX weights
    assert "padding per rank" in text and "http://" not in text.replace('xmlns="http://www.w3.org/2000/svg"', "")


def test_every_name_from_the_checkpoint_is_escaped(tmp_path):
    ckpt = tmp_path / "evil"
    dcp.save({f"model.{EVIL}": torch.arange(6.0), "model.ok": torch.ones(3)}, checkpoint_id=str(ckpt), no_dist=True)
    out = tmp_path / "evil.html"
    run = cli("inspect", str(ckpt), "--html", str(out))
    assert run.returncode == 0, run.stderr
    text = out.read_text()
    assert EVIL not in text and "&lt;img src=x onerror=alert(1)&gt;" in text


def test_bad_input_is_one_line_and_exit_1(ep_mx_ckpt, tmp_path):
    (tmp_path / "empty").mkdir()  # (the page beside it: one inside an input is refused first, for that)
    run = cli("inspect", str(tmp_path / "empty"), "--html", str(tmp_path / "x.html"))
    assert run.returncode == 1 and len(run.stderr.strip().splitlines()) == 1 and "not a checkpoint" in run.stderr
    assert not (tmp_path / "x.html").exists()
    missing = tmp_path / "no" / "such" / "dir" / "x.html"
    run = cli("inspect", ep_mx_ckpt, "--html", str(missing))
    assert run.returncode == 1 and len(run.stderr.strip().splitlines()) == 1, run.stderr
    assert str(missing) in run.stderr
    run = cli("inspect", ep_mx_ckpt, "--html", str(tmp_path))  # a directory
    assert run.returncode == 1 and "is a directory" in run.stderr


def test_png_without_a_browser_names_what_is_missing(ep_mx_ckpt, tmp_path):
    env = dict(ENV, PATH="/nonexistent")
    run = subprocess.run(
        [sys.executable, "-m", "cli.main", "inspect", ep_mx_ckpt, "--png", str(tmp_path / "x.png")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 1 and "chromium" in run.stderr and len(run.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "x.png").exists()


def _fixed_checkpoint(path) -> str:
    """Two 'ranks' of chunks, deterministic bytes: 2 data files written by one process."""
    state = {"model.w": torch.arange(96.0).reshape(12, 8), "model.b": torch.arange(5.0)}
    dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return str(path)


def test_svg_snapshot_of_a_small_fixed_checkpoint(tmp_path):
    layout = checkpoint_layout(_fixed_checkpoint(tmp_path / "fixed"))
    chunks = [c for c in layout.chunks if c.group == "model"]
    svg = rank_strips("model", chunks, layout.ranks, {0: "rank 0"})
    if os.environ.get("UPDATE_SNAPSHOTS"):
        with open(SNAPSHOT, "w", encoding="utf-8") as f:
            f.write(svg + "\n")
    with open(SNAPSHOT, encoding="utf-8") as f:
        assert svg + "\n" == f.read()


def test_page_renders_in_chromium_offline_with_a_strip_per_rank(ep_mx_ckpt, tmp_path):
    browser = _browser()
    from PIL import Image

    out, png = tmp_path / "page.html", tmp_path / "page.png"
    run = cli("inspect", ep_mx_ckpt, "--html", str(out), "--png", str(png))
    assert run.returncode == 0, run.stderr
    # the DOM after the page ran, with every host unresolvable and no proxy reachable
    dom = subprocess.run(
        [*browser_args(browser), f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", f"file://{out}"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    strips = re.search(r'<svg class="strips" data-group="model".*?</svg>', dom, re.S)
    assert strips and re.findall(r'data-rank="(\d+)"', strips.group(0)) == ["0", "1", "2"]
    image = Image.open(png).convert("RGB")
    colours = {image.getpixel((x, y)) for x in range(0, image.width, 2) for y in range(0, image.height, 2)}
    for rank in range(3):
        want = tuple(int(rank_color(rank)[i : i + 2], 16) for i in (1, 3, 5))
        assert any(max(abs(a - b) for a, b in zip(c, want)) <= 3 for c in colours), f"rank {rank} colour missing"


def test_escaped_names_run_nothing_in_the_browser(tmp_path):
    browser = _browser()
    ckpt = tmp_path / "evil"
    dcp.save(
        {"model.<img src=x onerror=\"document.title='pwned'\">": torch.ones(2)}, checkpoint_id=str(ckpt), no_dist=True
    )
    out = tmp_path / "evil.html"
    assert cli("inspect", str(ckpt), "--html", str(out)).returncode == 0
    dom = subprocess.run(
        [*browser_args(browser), f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", f"file://{out}"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert "pwned" not in re.search(r"<title>(.*?)</title>", dom, re.S).group(1)
    assert "<img" not in dom and "&lt;img src=x" in dom


def test_diff_page_highlights_what_differs_with_its_histogram(tmp_path):
    base = {"model.same": torch.arange(4.0), "model.w": torch.zeros(10), "model.gone": torch.ones(2)}
    dcp.save(base, checkpoint_id=str(tmp_path / "a"), no_dist=True)
    changed = {"model.same": torch.arange(4.0), "model.w": torch.tensor([0.0] * 8 + [5e-4, 5.0])}
    dcp.save(changed, checkpoint_id=str(tmp_path / "b"), no_dist=True)
    out = tmp_path / "diff.html"
    run = cli("diff", str(tmp_path / "a"), str(tmp_path / "b"), "--html", str(out), "--json")
    assert run.returncode == 1, run.stderr  # they differ
    result = json.loads(run.stdout)
    (w,) = [d for d in result["different"] if d["key"] == "model.w"]
    assert w["histogram"][0] == 8 and w["histogram"][HISTOGRAM_BINS.index("<=1e-3")] == 1
    assert w["histogram"][HISTOGRAM_BINS.index("<=1e1")] == 1 and w["rel"] == pytest.approx(
        1.0, rel=1e-12
    )  # a is zero: ||a - b|| = ||b||
    text = out.read_text()
    rows = re.findall(r'<tr class="differs" data-key="([^"]+)"', text)
    assert rows == ["model.w", "model.gone"] and 'class="hist"' in text
    assert "2 common entries compared: 1 differ, 1 only in A, 0 only in B" in text


def test_megatron_core_checkpoint_page(tmp_path):
    out = tmp_path / "mcore.html"
    run = cli("inspect", os.path.join(ROOT, "fixtures", "mcore", "dense"), "--html", str(out))
    assert run.returncode == 0, run.stderr
    text = out.read_text()
    assert re.search(r'<g class="strip" data-rank="0"', text) and "<h2>data files</h2>" in text


@pytest.mark.heavy
def test_hsdp_page_names_the_replica_of_each_writer(tmp_path):
    run = run_train(
        4,
        "--model",
        "tiny",
        "--dp-replicate",
        "2",
        "--steps",
        "1",
        "--save-every",
        "1",
        "--ckpt-dir",
        str(tmp_path / "run"),
    )
    assert run.returncode == 0, failure(run)
    out = tmp_path / "hsdp.html"
    assert cli("inspect", str(tmp_path / "run" / "step_000001"), "--html", str(out)).returncode == 0
    text = out.read_text()
    assert "HSDP</th><td><code>2 replica groups" in text
    for rank, replica in ((0, 0), (1, 0), (2, 1), (3, 1)):
        assert f"rank {rank} · replica {replica}" in text
