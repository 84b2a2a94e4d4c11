"""A Hugging Face model directory given to a checkpoint command is named as such, on one line,
with the import-hf command that makes a checkpoint of it (not a bare "no .metadata")."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file


@pytest.fixture
def hf_dir(tmp_path):
    d = tmp_path / "hf_model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    save_file({"model.embed_tokens.weight": torch.zeros(4, 4)}, str(d / "model.safetensors"))
    return str(d)


@pytest.mark.parametrize(
    "args",
    [["inspect", "{d}"], ["verify", "{d}"], ["diff", "{d}", "{d}"], ["convert", "{d}", "{out}/x.pt", "--to", "torch"]],
    ids=lambda a: a[0],
)
def test_a_hf_model_dir_points_to_import_hf(hf_dir, tmp_path, args):
    argv = [a.format(d=hf_dir, out=tmp_path) for a in args]
    run = subprocess.run([sys.executable, "-m", "cli.main", *argv], capture_output=True, text=True, timeout=300)
    assert run.returncode != 0
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, run.stderr
    assert "a Hugging Face model directory" in lines[0] and f"'mfsdp-ckpt import-hf {hf_dir} OUT'" in lines[0]
