"""Every ``mfsdp-ckpt`` command on ``s3://`` URLs, against a real local S3 server (moto, bound to
127.0.0.1) through s3fs: inspect, verify (and a corrupted object named), diff, ls, reshard
(S3 → S3, committed by writing the manifest last; a failed one leaves nothing), convert both ways."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import fsspec
import pytest
import torch
from click.testing import CliRunner

import mfsdp_ckpt
from cli.main import main
from mfsdp_ckpt.read.locate import chunk_table
from mfsdp_ckpt.tools.diff import diff_checkpoints
from mfsdp_ckpt.tools.inspect import verify_checkpoint
from tests.mfsdp_ckpt.util import build, owned_pieces, train_steps

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _save(root: str) -> None:
    model, optim = build("optim_grads_params", "row")
    train_steps(model, optim, 0, 2)
    mfsdp_ckpt.save(os.path.join(root, "step_2"), model, optim, extra={"step": 2}, step=2)


@pytest.fixture(scope="module")
def local_run(tmp_path_factory) -> str:
    from tests.harness import run_ranks

    root = str(tmp_path_factory.mktemp("s3src") / "run")
    run_ranks(_save, 3, root, timeout=300)
    return root


def _s3() -> fsspec.AbstractFileSystem:
    return fsspec.filesystem("s3", skip_instance_cache=True)


def _cli(*args: str):
    return CliRunner().invoke(main, list(args))


@pytest.mark.heavy
def test_commands_on_s3(local_run, s3_bucket):
    s3 = _s3()
    s3.put(local_run, f"{s3_bucket}/run", recursive=True)
    url = f"{s3_bucket}/run/step_2"

    res = _cli("inspect", url, "--json")
    assert res.exit_code == 0, res.output
    info = json.loads(res.output)
    assert info["format"] == "mfsdp" and info["step"] == 2 and info["writer"]["world_size"] == 3

    assert _cli("verify", url).exit_code == 0
    assert _cli("verify", f"{s3_bucket}/run/latest").exit_code == 0  # the pointer file resolves on S3 too
    res = _cli("diff", os.path.join(local_run, "step_2"), url)
    assert res.exit_code == 0 and "equal" in res.output, res.output

    res = _cli("ls", f"{s3_bucket}/run", "--json")
    assert res.exit_code == 0, res.output
    [entry] = json.loads(res.output)
    assert entry["name"] == "step_2" and entry["committed"] and entry["latest"] and entry["bytes"] > 0

    # reshard S3 -> S3, through a real subprocess (it reads the endpoint from the environment)
    out = subprocess.run(
        [sys.executable, "-m", "cli.main", "reshard", url, f"{s3_bucket}/w2", "--world-size", "2", "--workers", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert sorted(s3.ls(f"{s3_bucket}/w2", detail=False)) == sorted(
        f"{s3_bucket[5:]}/w2/{n}" for n in (".metadata", "__0_0.distcp", "__1_0.distcp", "mfsdp.json")
    )
    assert verify_checkpoint(f"{s3_bucket}/w2") == []
    assert diff_checkpoints(url, f"{s3_bucket}/w2").equal
    assert _cli("reshard", f"{s3_bucket}/w2", f"{s3_bucket}/w2").exit_code == 2  # --world-size missing: usage error

    # convert both ways on S3
    assert _cli("convert", url, f"{s3_bucket}/flat.safetensors", "--to", "safetensors").exit_code == 0
    res = _cli("convert", f"{s3_bucket}/flat.safetensors", f"{s3_bucket}/back", "--to", "dcp")
    assert res.exit_code == 0, res.output
    assert diff_checkpoints(url, f"{s3_bucket}/back").equal


def test_s3_faults_are_named_and_failed_writes_leave_nothing(local_run, s3_bucket):
    s3 = _s3()
    s3.put(os.path.join(local_run, "step_2"), f"{s3_bucket}/src", recursive=True)
    src = f"{s3_bucket}/src"

    # DST exists: refused, untouched
    res = _cli("reshard", src, src, "--world-size", "2")
    assert res.exit_code == 1 and "already exists" in res.output

    # a flipped byte inside a data object: verify names the object and the key; reshard refuses,
    # leaving nothing at DST
    cid, chunk = next((c, v) for c, v in chunk_table(src).items() if c.startswith("model.") and v["length"] > 2000)
    path = f"{src}/{chunk['file']}"
    data = bytearray(s3.cat(path))
    data[chunk["offset"] + chunk["length"] // 2] ^= 0xFF
    s3.pipe(path, bytes(data))
    res = _cli("verify", src)
    assert res.exit_code == 1 and chunk["file"] in res.output and cid.split("@")[0] in res.output, res.output
    res = _cli("reshard", src, f"{s3_bucket}/out", "--world-size", "3")
    assert res.exit_code == 1 and "checksum mismatch" in res.output, res.output
    assert not s3.exists(f"{s3_bucket}/out")

    # uncommitted (no manifest) and nonexistent prefixes: one line, exit 1
    s3.rm(f"{src}/mfsdp.json")
    res = _cli("reshard", src, f"{s3_bucket}/out", "--world-size", "3")
    assert res.exit_code == 1 and "mfsdp.json" in res.output
    res = _cli("verify", f"{s3_bucket}/nothing-here")
    assert res.exit_code == 1 and "no such checkpoint" in res.output
    assert not s3.exists(f"{s3_bucket}/out")


def _save_and_load_on_s3(url: str, endpoint: str) -> bool:
    from tests.s3 import use_endpoint

    use_endpoint(endpoint)
    model, optim = build("optim_grads_params", "row")
    train_steps(model, optim, 0, 2)
    mfsdp_ckpt.save(f"{url}/step_2", model, optim, extra={"step": 2}, step=2)
    with pytest.raises(mfsdp_ckpt.CheckpointError, match="already exists"):
        mfsdp_ckpt.save(f"{url}/step_2", model, optim)
    again, again_optim = build("optim_grads_params", "row", seed=5)
    assert mfsdp_ckpt.load(url, again, again_optim) == {"step": 2}  # through ``latest``, an object
    mine, loaded = owned_pieces(model, optim), owned_pieces(again, again_optim)
    return mine.keys() == loaded.keys() and all(torch.equal(mine[k][2], loaded[k][2]) for k in mine)


def test_training_save_and_load_take_urls(local_run, s3_endpoint, s3_bucket):
    """Replaces the former refusal of URLs by ``save`` / ``load``: both now work on ``s3://``
    (tests/mfsdp_ckpt/storage/test_s3_checkpoint.py and tests/cli/test_train_s3.py cover them fully), and
    an S3 save of the same state diffs equal to the local one."""
    from tests.harness import run_ranks

    url = f"{s3_bucket}/trained"
    assert all(run_ranks(_save_and_load_on_s3, 3, url, s3_endpoint, timeout=300))
    assert _s3().cat(f"{url}/latest") == b"step_2\n"
    assert verify_checkpoint(f"{url}/step_2") == []
    assert diff_checkpoints(os.path.join(local_run, "step_2"), f"{url}/step_2").equal


def test_hf_bridge_checkpoint_side_on_s3(s3_bucket, tmp_path):
    """import-hf writes a checkpoint to S3 (manifest last); export-hf reads it back from S3; the
    tensors come back bitwise."""
    from tests.mfsdp_ckpt.hf.util import hf_config, hf_tensors, random_hf_model, save_hf

    hf_dir = save_hf(random_hf_model(hf_config("qwen3")), str(tmp_path / "hf"))
    ckpt = f"{s3_bucket}/from_hf"
    res = _cli("import-hf", hf_dir, ckpt)
    assert res.exit_code == 0, res.output
    assert verify_checkpoint(ckpt) == []
    res = _cli("export-hf", ckpt, str(tmp_path / "out"))
    assert res.exit_code == 0, res.output
    before, after = hf_tensors(hf_dir), hf_tensors(str(tmp_path / "out"))
    assert before.keys() == after.keys()
    assert all(before[k].dtype == after[k].dtype and torch.equal(before[k], after[k]) for k in before)
    res = _cli("export-hf", ckpt, f"{s3_bucket}/hf_out")
    assert res.exit_code == 1 and "must be a local path" in res.output
