"""``mfsdp-ckpt inspect / verify / ls``, through click's runner and as a real subprocess."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from click.testing import CliRunner

import mfsdp_ckpt
from cli.main import main
from mfsdp_ckpt.read.locate import chunk_table
from tests.mfsdp_ckpt.util import build, train_steps

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _save_run(root: str) -> None:
    model, optim = build("optim_grads_params", "row")
    for step in (1, 2):
        train_steps(model, optim, step - 1, step)
        mfsdp_ckpt.save(
            os.path.join(root, f"step_{step}"),
            model,
            optim,
            extra={"step": step},
            step=step,
            model_config={"name": "test-transformer"},
        )


def _save_elsewhere(src: str, dst: str, grads: bool) -> None:
    """The same state, loaded and re-saved at another world size and layout."""
    model, optim = build("optim", "tensor", seed=5)
    mfsdp_ckpt.load(src, model, optim)
    mfsdp_ckpt.save(dst, model, optim, extra={"step": 2}, include_grads=grads, update_latest=False)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    from tests.harness import run_ranks

    root = str(tmp_path_factory.mktemp("cli") / "run")
    run_ranks(_save_run, 3, root, timeout=300)
    return root


def _cli(*args: str):
    return CliRunner().invoke(main, list(args))


def test_inspect_lists_groups_layout_and_totals(run_dir):
    result = _cli("inspect", os.path.join(run_dir, "latest"))
    assert result.exit_code == 0, result.output
    out = result.output
    assert "format      mfsdp" in out and "step        2" in out
    assert "writer      world size 3; optim_grads_params/row over 3" in out
    assert "[model]" in out and "[optim]" in out and "[extra]" in out
    assert "model.block.qkv.weight" in out and "96x32" in out
    data = json.loads(_cli("inspect", "--json", os.path.join(run_dir, "step_1")).output)
    assert data["step"] == 1 and data["model_config"] == {"name": "test-transformer"}
    keys = {t["key"]: t for t in data["tensor_list"]}
    assert data["tensors"] == len(data["tensor_list"])
    assert (
        keys["model.block.qkv.weight"]["shape"] == [96, 32] and keys["model.block.qkv.weight"]["bytes"] == 96 * 32 * 4
    )
    assert keys["optim.block.qkv.weight.exp_avg"]["group"] == "optim"
    assert data["totals"]["model"]["tensors"] == len([k for k in keys if k.startswith("model.")])


def test_inspect_stock_checkpoint_says_what_it_cannot_know(tmp_path):
    dcp.save({"model.w": torch.ones(4, 3), "step": 7}, checkpoint_id=str(tmp_path / "stock"), no_dist=True)
    result = _cli("inspect", str(tmp_path / "stock"))
    assert result.exit_code == 0, result.output
    assert "stock DCP" in result.output and "unknown     writer layout, model config, step" in result.output
    assert "model.w" in result.output and "4x3" in result.output


def test_verify_ok_then_reports_each_fault(run_dir, tmp_path):
    result = _cli("verify", os.path.join(run_dir, "step_2"))
    assert result.exit_code == 0 and result.output.startswith("ok: ")
    broken = str(tmp_path / "broken")
    shutil.copytree(os.path.join(run_dir, "step_2"), broken)
    chunks = chunk_table(broken)
    key = max((k for k in chunks if k.startswith("optim.block.fc1.weight.exp_avg@")), key=lambda k: chunks[k]["length"])
    entry = chunks[key]
    with open(os.path.join(broken, entry["file"]), "r+b") as f:
        f.seek(entry["offset"] + entry["length"] // 2)
        b = f.read(1)
        f.seek(entry["offset"] + entry["length"] // 2)
        f.write(bytes([b[0] ^ 1]))
    result = _cli("verify", broken)
    assert result.exit_code == 1
    fqn, offsets = key.split("@")
    assert f"FAULT {entry['file']}: {fqn} at [{offsets.replace(',', ', ')}]: checksum mismatch" in result.output
    assert "1 fault(s)" in result.output
    faults = json.loads(_cli("verify", "--json", broken).output)["faults"]
    assert [f["key"] for f in faults] == [fqn]


def test_verify_names_a_truncated_file_and_a_missing_manifest(run_dir, tmp_path):
    broken = str(tmp_path / "short")
    shutil.copytree(os.path.join(run_dir, "step_1"), broken)
    data_file = sorted(n for n in os.listdir(broken) if n.endswith(".distcp"))[0]
    os.truncate(os.path.join(broken, data_file), 100)
    os.remove(os.path.join(broken, "mfsdp.json"))
    result = _cli("verify", broken)
    assert result.exit_code == 1
    assert (
        "FAULT mfsdp.json: -: missing" in result.output
    )  # an mfsdp checkpoint that lost its manifest is not stock DCP
    assert f"FAULT {data_file}: " in result.output and "truncated" in result.output


def test_ls_shows_steps_latest_and_uncommitted(run_dir, tmp_path):
    root = str(tmp_path / "ls")
    shutil.copytree(run_dir, root, symlinks=True)  # latest-checkpoint stays a link, as cp -r / rsync -a keep it
    shutil.copytree(os.path.join(root, "step_2"), os.path.join(root, ".step_3.partial-abc"))
    os.remove(os.path.join(root, ".step_3.partial-abc", "mfsdp.json"))
    result = _cli("ls", root)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith("step_1") and "committed" in lines[0] and "latest" not in lines[0]
    assert lines[1].startswith("step_2") and lines[1].endswith("<- latest")
    assert lines[2].startswith(".step_3.partial-abc") and "UNCOMMITTED" in lines[2]
    entries = json.loads(_cli("ls", "--json", root).output)
    assert [(e["name"], e.get("step"), e["committed"]) for e in entries] == [
        ("step_1", 1, True),
        ("step_2", 2, True),
        (".step_3.partial-abc", None, False),
    ]
    assert "step" not in entries[2]  # absent, not null: the partial save records no step


@pytest.mark.parametrize("command", ["inspect", "verify", "ls"])
def test_path_that_does_not_exist(tmp_path, command):
    result = _cli(command, str(tmp_path / "nope"))
    assert result.exit_code == 1
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1
    assert str(tmp_path / "nope") in result.stderr


def test_directory_that_is_not_a_checkpoint(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    for command in ("inspect", "verify"):
        result = _cli(command, str(tmp_path))
        assert result.exit_code == 1 and "not a checkpoint (no .metadata)" in result.stderr


def test_usage_error_exits_2():
    assert _cli("verify").exit_code == 2
    assert _cli("frobnicate").exit_code == 2


@pytest.mark.heavy
def test_real_subprocess(run_dir):
    env = dict(os.environ, PYTHONPATH=ROOT)
    ok = subprocess.run(
        [sys.executable, "-m", "cli.main", "verify", os.path.join(run_dir, "latest")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ok.returncode == 0 and ok.stdout.startswith("ok: ")
    missing = subprocess.run(
        [sys.executable, "-m", "cli.main", "inspect", "/nonexistent/ckpt"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert missing.returncode == 1 and missing.stderr == "error: /nonexistent/ckpt: no such checkpoint\n"
    listing = subprocess.run(
        [sys.executable, "-m", "cli.main", "ls", "--json", run_dir],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert listing.returncode == 0 and [e["name"] for e in json.loads(listing.stdout)] == ["step_1", "step_2"]
    differ = subprocess.run(
        [sys.executable, "-m", "cli.main", "diff", os.path.join(run_dir, "step_1"), os.path.join(run_dir, "step_2")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert differ.returncode == 1 and differ.stdout.rstrip().endswith("common entries compared")
    assert differ.stderr == ""


def test_convert_as_a_real_subprocess(run_dir, tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT)
    out = str(tmp_path / "flat.pt")
    done = subprocess.run(
        [sys.executable, "-m", "cli.main", "convert", os.path.join(run_dir, "latest"), out, "--to", "torch"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and done.stdout == f"wrote {out}\n", done.stderr
    again = subprocess.run(
        [sys.executable, "-m", "cli.main", "convert", os.path.join(run_dir, "latest"), out, "--to", "torch"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert again.returncode == 1 and again.stderr.startswith("error: ") and "already exists" in again.stderr
    assert len(again.stderr.splitlines()) == 1


def test_diff_equal_across_layouts_and_reports_differences(run_dir, tmp_path):
    from tests.harness import run_ranks

    same = str(tmp_path / "same")
    run_ranks(_save_elsewhere, 2, os.path.join(run_dir, "step_2"), same, False, timeout=300)
    result = _cli("diff", os.path.join(run_dir, "step_2"), same)
    assert result.exit_code == 0, result.output
    assert result.output.startswith("equal: ")
    result = _cli("diff", os.path.join(run_dir, "step_1"), os.path.join(run_dir, "step_2"))
    assert result.exit_code == 1
    assert "values     model.block.qkv.weight: max |a - b| = " in result.output
    assert "object     extra.step: 1 vs 2" in result.output
    grads = str(tmp_path / "grads")
    run_ranks(_save_elsewhere, 3, os.path.join(run_dir, "step_2"), grads, True, timeout=300)
    data = json.loads(_cli("diff", "--json", os.path.join(run_dir, "step_2"), grads).output)
    assert not data["equal"] and data["only_in_a"] == [] and "grad.block.qkv.weight" in data["only_in_b"]
    assert data["different"] == []
    loose = _cli("diff", "--atol", "1", os.path.join(run_dir, "step_1"), os.path.join(run_dir, "step_2"))
    assert "values" not in loose.output  # within tolerance now; only extra.step differs


def test_convert_round_trips_through_torch_and_safetensors(run_dir, tmp_path):
    src = os.path.join(run_dir, "step_2")
    for fmt, name in (("torch", "full.pt"), ("safetensors", "full.safetensors")):
        single = str(tmp_path / name)
        result = _cli("convert", src, single, "--to", fmt)
        assert result.exit_code == 0, result.output + result.stderr
        back = str(tmp_path / f"back_{fmt}")
        result = _cli("convert", single, back, "--to", "dcp", "--json")
        assert result.exit_code == 0, result.output + result.stderr
        doc = json.loads(result.output)
        assert doc.pop("seconds") >= 0  # the vocabulary's wall time (docs/cli.md)
        assert doc == {"path": back, "format": "dcp"}
        assert _cli("verify", back).exit_code == 0
        result = _cli("diff", src, back)
        assert result.exit_code == 0, result.output  # every tensor and object, bitwise
    full = torch.load(str(tmp_path / "full.pt"), weights_only=True)  # a plain torch file
    assert full["model.block.qkv.weight"].shape == (96, 32) and full["extra.step"] == 2
    from safetensors.torch import load_file

    flat = load_file(str(tmp_path / "full.safetensors"))
    assert torch.equal(flat["model.block.qkv.weight"], full["model.block.qkv.weight"])


def test_convert_bad_input(run_dir, tmp_path):
    src = os.path.join(run_dir, "step_2")
    existing = tmp_path / "exists.pt"
    existing.write_bytes(b"keep me")
    result = _cli("convert", src, str(existing), "--to", "torch")
    assert result.exit_code == 1 and "already exists" in result.stderr
    assert existing.read_bytes() == b"keep me"
    assert _cli("convert", src, str(tmp_path / "x"), "--to", "onnx").exit_code == 2
    result = _cli("convert", src, str(tmp_path / "y"), "--to", "dcp")
    assert result.exit_code == 1 and "not a file" in result.stderr
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"\x80\x04not a pickle")
    result = _cli("convert", str(garbage), str(tmp_path / "z"), "--to", "dcp")
    assert result.exit_code == 1 and "garbage.pt: not a loadable torch file" in result.stderr
    assert not (tmp_path / "z").exists()
