"""``mfsdp-ckpt import-hf / export-hf``, through click's runner and as a real subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

pytest.importorskip("transformers")

from cli.main import main
from tests.mfsdp_ckpt.hf.util import hf_config, hf_tensors, random_hf_model, save_hf

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cli(*args: str):
    return CliRunner().invoke(main, list(args))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return save_hf(
        random_hf_model(hf_config("qwen3", tie_word_embeddings=True)), str(tmp_path_factory.mktemp("hf") / "qwen3")
    )


def test_import_then_export_round_trip(hf_dir, tmp_path):
    result = _cli("import-hf", hf_dir, str(tmp_path / "ckpt"))
    assert result.exit_code == 0, result.output
    assert result.output.startswith(
        f"wrote {tmp_path / 'ckpt'}: qwen3, 18 tensors"
    )  # 1 + 2 layers x 8 + 1 (tied: no output layer)
    assert _cli("verify", str(tmp_path / "ckpt")).exit_code == 0
    result = _cli("export-hf", str(tmp_path / "ckpt"), str(tmp_path / "out"), "--max-shard-size", "50KB", "--json")
    assert result.exit_code == 0, result.output
    info = json.loads(result.output)
    assert info["architecture"] == "qwen3" and info["files"] == len(info["file_names"]) > 1
    a, b = hf_tensors(hf_dir), hf_tensors(str(tmp_path / "out"))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_dtype_and_arch_flags(hf_dir, tmp_path):
    assert _cli("import-hf", hf_dir, str(tmp_path / "ckpt"), "--arch", "qwen3").exit_code == 0
    result = _cli("export-hf", str(tmp_path / "ckpt"), str(tmp_path / "out"), "--dtype", "float16", "--arch", "qwen3")
    assert result.exit_code == 0, result.output
    assert {t.dtype for t in hf_tensors(str(tmp_path / "out")).values()} == {torch.float16}
    assert _cli("export-hf", str(tmp_path / "ckpt"), str(tmp_path / "o2"), "--dtype", "int8").exit_code == 2


def test_errors_are_one_line_and_leave_nothing(hf_dir, tmp_path):
    result = _cli("import-hf", hf_dir, str(tmp_path / "ckpt"), "--arch", "bert")
    assert result.exit_code == 1
    assert (
        result.output
        == "error: unknown architecture 'bert'; known: deepseek_v3, llama, mixtral, qwen2, qwen3, qwen3_moe, qwen3_next\n"
    )
    assert _cli("import-hf", hf_dir, str(tmp_path / "ckpt")).exit_code == 0
    result = _cli("export-hf", str(tmp_path / "ckpt"), str(tmp_path / "out"), "--arch", "llama")
    assert result.exit_code == 1 and result.output.count("\n") == 1
    assert result.output.startswith("error: ") and "cannot be expressed as llama: qk_layernorm=True" in result.output
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    again = _cli("import-hf", hf_dir, str(tmp_path / "ckpt"))
    assert again.exit_code == 1 and "already exists" in again.output
    assert _cli("import-hf", hf_dir, str(tmp_path / "ckpt"), "--overwrite").exit_code == 0


@pytest.mark.heavy
def test_real_subprocess(hf_dir, tmp_path):
    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "cli.main", *args], cwd=ROOT, capture_output=True, text=True, timeout=300
        )

    ok = run("import-hf", hf_dir, str(tmp_path / "ckpt"))
    assert ok.returncode == 0, ok.stderr
    ok = run("export-hf", str(tmp_path / "ckpt"), str(tmp_path / "out"), "--json")
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["file_names"] == ["model-00001-of-00001.safetensors"]
    bad = run("import-hf", str(tmp_path / "nowhere"), str(tmp_path / "c2"))
    assert bad.returncode == 1
    assert bad.stderr == f"error: {tmp_path / 'nowhere'}: not a directory\n"
    assert not os.path.exists(tmp_path / "c2")
