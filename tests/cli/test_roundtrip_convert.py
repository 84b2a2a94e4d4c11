"""``convert`` round trips keep what the manifest carries (step, model config and source, run
config): a checkpoint taken DCP -> safetensors -> DCP or DCP -> torch -> DCP still names its model,
so the trainer starts from it (``--init-from``, two torchrun ranks) and ``export-hf`` exports it;
and a checkpoint that records no model is taken with ``--model`` and refused, on one line, without."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mfsdp_ckpt.read.manifest import read_manifest
from mfsdp_ckpt.tools.convert import read_full_state, write_dcp
from tests.torchrun import ENV, ROOT, failure
from tests.torchrun import run_train as _run

KEPT = ("step", "model_config", "model_source", "run_config")


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> str:
    ckpt = str(tmp_path_factory.mktemp("trained") / "run")
    run = _run(None, "--model", "tiny", "--steps", "3", "--save-every", "3", "--ckpt-dir", ckpt, timeout=600)
    assert run.returncode == 0, failure(run)
    return os.path.join(ckpt, "latest")


def _cli(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "cli.main", *args]
    return subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)


@pytest.mark.heavy
@pytest.mark.parametrize("middle", ["f.safetensors", "f.pt"])
def test_a_round_trip_keeps_step_model_and_trains_and_exports(trained, tmp_path, middle):
    fmt = "safetensors" if middle.endswith(".safetensors") else "torch"
    single, back = str(tmp_path / middle), str(tmp_path / "back")
    assert _cli("convert", trained, single, "--to", fmt).returncode == 0
    run = _cli("convert", single, back, "--to", "dcp")
    assert run.returncode == 0, run.stderr
    source, result = read_manifest(_resolved(trained)), read_manifest(back)
    assert source["step"] == 3 and source["model_source"] is not None
    assert {k: result.get(k) for k in KEPT} == {k: source.get(k) for k in KEPT}
    assert "__mfsdp_manifest__" not in read_full_state(back)  # the reserved key is not an entry
    run = _run(2, "--init-from", back, "--steps", "2", "--ckpt-dir", str(tmp_path / "again"), timeout=600)
    assert run.returncode == 0, failure(run)
    run = _cli("export-hf", back, str(tmp_path / "hf"))
    assert run.returncode == 0, run.stderr
    assert os.path.isfile(tmp_path / "hf" / "config.json")


def _resolved(path: str) -> str:
    import mfsdp_ckpt

    return mfsdp_ckpt.resolve_checkpoint(path)


@pytest.mark.heavy  # slow (the inner loop's 8 minutes); CI runs it
def test_a_checkpoint_without_a_model_config_is_named_by_model(trained, tmp_path):
    bare = str(tmp_path / "bare")
    write_dcp({k: v for k, v in read_full_state(trained).items() if k.startswith("model.")}, bare)
    assert read_manifest(bare).get("model_source") is None
    run = _run(None, "--init-from", bare, "--steps", "1", "--ckpt-dir", str(tmp_path / "a"), timeout=600)
    assert run.returncode != 0
    said = [line for line in run.stderr.splitlines() if "records no model config" in line]
    assert len(said) == 1 and "--model" in said[0] and bare in said[0], failure(run)
    assert "=None" not in run.stderr
    run = _run(None, "--init-from", bare, "--model", "tiny", "--steps", "1", "--ckpt-dir", str(tmp_path / "b"))
    assert run.returncode == 0, failure(run)


@pytest.mark.heavy  # slow (the inner loop's 8 minutes); CI runs it
def test_export_hf_of_a_checkpoint_without_a_model_config_takes_arch_and_model_config(trained, tmp_path):
    """The bare checkpoint is refused by ``export-hf`` with a pointer to ``--model-config``; given
    the config (here: the source's manifest) and ``--arch``, it exports the same tensors as the
    source's own export, bit for bit."""
    bare = str(tmp_path / "bare")
    write_dcp({k: v for k, v in read_full_state(trained).items() if k.startswith("model.")}, bare)
    refused = _cli("export-hf", bare, str(tmp_path / "no"))
    assert refused.returncode == 1
    assert refused.stderr.strip().endswith("name it with --model-config FILE.json"), refused.stderr
    assert not os.path.exists(tmp_path / "no")
    manifest = os.path.join(_resolved(trained), "mfsdp.json")
    run = _cli("export-hf", bare, str(tmp_path / "hf"), "--arch", "llama", "--model-config", manifest)
    assert run.returncode == 0, run.stderr
    ref = _cli("export-hf", trained, str(tmp_path / "ref"), "--arch", "llama")
    assert ref.returncode == 0, ref.stderr
    from safetensors.torch import load_file

    def tensors(d):
        out = {}
        for name in sorted(os.listdir(d)):
            if name.endswith(".safetensors"):
                out.update(load_file(os.path.join(d, name)))
        return out

    a, b = tensors(tmp_path / "hf"), tensors(tmp_path / "ref")
    assert a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and a[k].equal(b[k]) for k in a)
