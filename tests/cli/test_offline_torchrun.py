"""The offline tools as torchrun jobs: ``torchrun --standalone --nproc-per-node 3 -m cli.main
COMMAND ...`` writes the same files, with the same bytes, as the single process; a process that
fails or is killed leaves nothing committed, a non-zero exit and one error line.

One small checkpoint (``mfsdp-train --model tiny``, two steps on two ranks) feeds every command;
sizes are cut small (``--max-shard-size`` / ``--max-file-size``) so that each output has several
files for the three processes to share out. The single-process runs go through click's runner
(no torchrun environment: the tools run as before)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from cli.main import main
from mfsdp_ckpt.format.names import MANIFEST_NAME, METADATA_NAME
from mfsdp_ckpt.format.safety import safe_load_metadata
from tests.torchrun import ENV, ROOT, failure, run_train

pytestmark = pytest.mark.heavy  # slow (the inner loop's 8 minutes); CI runs it

NPROC = 3
#: manifest fields that differ between any two writes of the same output
VOLATILE = {"save_id", "created_unix", "manifest_crc32c", "metadata_crc32c"}


def torchrun(*args: str, env: dict[str, str] | None = None, module: str = "cli.main") -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node 3 -m MODULE ARGS``, from the checkout."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={NPROC}"]
    return subprocess.run(
        [*cmd, "-m", module, *args], cwd=ROOT, env={**ENV, **(env or {})}, capture_output=True, text=True, timeout=300
    )


def single(*args: str) -> str:
    """The command in this process, as one process (no torchrun environment); its stdout."""
    res = CliRunner().invoke(main, list(args))
    assert res.exit_code == 0, res.output
    return res.output


def error_lines(run: subprocess.CompletedProcess) -> list[str]:
    """The lines of the job's stderr that are ours (``error: ...``), torchrun's report aside."""
    return [line for line in run.stderr.splitlines() if line.startswith("error:")]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    """A committed checkpoint of the dense ``tiny`` model (optimizer state included)."""
    root = tmp_path_factory.mktemp("offline_torchrun")
    run = run_train(2, "--model", "tiny", "--steps", "2", "--save-every", "2", "--ckpt-dir", str(root / "run"))
    assert run.returncode == 0, failure(run)
    return str(root / "run" / "step_000002")


def _metadata(path: str):
    with open(os.path.join(path, METADATA_NAME), "rb") as f:
        return safe_load_metadata(f.read(), path)


def _manifest(path: str) -> dict:
    with open(os.path.join(path, MANIFEST_NAME)) as f:
        return {k: v for k, v in json.load(f).items() if k not in VOLATILE}


def assert_same_output(a: str, b: str) -> None:
    """``a`` and ``b`` hold the same files; every file but ``.metadata`` and the manifest has the
    same bytes; those two say the same (ids and times aside)."""
    names = sorted(os.listdir(a))
    assert names == sorted(os.listdir(b))
    for name in names:
        if name in (METADATA_NAME, MANIFEST_NAME):
            continue
        with open(os.path.join(a, name), "rb") as fa, open(os.path.join(b, name), "rb") as fb:
            assert fa.read() == fb.read(), name
    if MANIFEST_NAME in names:
        assert _manifest(a) == _manifest(b)
    if METADATA_NAME in names:
        ma, mb = _metadata(a), _metadata(b)
        assert ma.state_dict_metadata == mb.state_dict_metadata
        assert ma.storage_data == mb.storage_data


def _job(tmp_path, *args: str) -> tuple[str, str]:
    """``args`` with ``{out}`` as a destination, run once alone and once as a job of 3: the two
    destinations, after checking the job said its one line."""
    one, many = str(tmp_path / "one"), str(tmp_path / "many")
    single(*[one if a == "{out}" else a for a in args])
    run = torchrun(*[many if a == "{out}" else a for a in args])
    assert run.returncode == 0, failure(run)
    assert run.stdout.count("wrote ") == 1, run.stdout  # process 0 alone reports
    return one, many


def test_reshard_as_a_job_writes_what_one_process_writes(ckpt, tmp_path):
    one, many = _job(tmp_path, "reshard", ckpt, "{out}", "--world-size", "5")
    assert sorted(n for n in os.listdir(many) if n.endswith(".distcp")) == [f"__{r}_0.distcp" for r in range(5)]
    assert_same_output(one, many)


@pytest.mark.heavy
def test_export_hf_as_a_job_writes_what_one_process_writes(ckpt, tmp_path):
    one, many = _job(tmp_path, "export-hf", ckpt, "{out}", "--max-shard-size", "100KB")
    assert len([n for n in os.listdir(many) if n.endswith(".safetensors")]) >= NPROC
    assert_same_output(one, many)


def test_import_hf_as_a_job_writes_what_one_process_writes(ckpt, tmp_path):
    hf_dir = str(tmp_path / "hf")
    single("export-hf", ckpt, hf_dir, "--max-shard-size", "100KB")
    one, many = _job(tmp_path, "import-hf", hf_dir, "{out}", "--max-file-size", "100KB")
    assert len([n for n in os.listdir(many) if n.endswith(".distcp")]) >= NPROC
    assert_same_output(one, many)
    whole = str(tmp_path / "whole")  # the default size: one data file, as import-hf always wrote
    single("import-hf", hf_dir, whole)
    assert sorted(n for n in os.listdir(whole) if n.endswith(".distcp")) == ["__0_0.distcp"]
    assert single("diff", many, whole).startswith("equal:")


def test_export_mcore_as_a_job_writes_what_one_process_writes(ckpt, tmp_path):
    one, many = _job(tmp_path, "export-mcore", ckpt, "{out}", "--max-file-size", "100KB")
    assert len([n for n in os.listdir(many) if n.endswith(".distcp")]) >= NPROC
    assert_same_output(one, many)


def test_convert_as_a_job_writes_what_one_process_writes(ckpt, tmp_path):
    one, many = _job(tmp_path, "convert", ckpt, "{out}", "--to", "dcp-fsdp2", "--max-file-size", "100KB")
    assert len([n for n in os.listdir(many) if n.endswith(".distcp")]) >= NPROC
    assert_same_output(one, many)


@pytest.mark.heavy
def test_convert_to_one_file_as_a_job_writes_it_once(ckpt, tmp_path):
    """A single file cannot be shared out: process 0 writes it, once every process has reported."""
    for to, name in (("safetensors", "full.safetensors"), ("torch", "full.pt")):
        single("convert", ckpt, str(tmp_path / f"a_{name}"), "--to", to)
        run = torchrun("convert", ckpt, str(tmp_path / f"b_{name}"), "--to", to)
        assert run.returncode == 0, failure(run)
        a, b = (tmp_path / f"a_{name}").read_bytes(), (tmp_path / f"b_{name}").read_bytes()
        if to == "safetensors":  # the safetensors library writes its metadata's keys in no fixed order
            a, b = _safetensors_parts(a), _safetensors_parts(b)
        assert a == b, to


def _safetensors_parts(data: bytes) -> tuple[dict, bytes]:
    """A safetensors file as its header (parsed) and its data section."""
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + n]), data[8 + n :]


@pytest.mark.parametrize("fault", ["MFSDP_TEST_KILL_RANK", "MFSDP_TEST_FAIL_RANK"])
def test_a_process_that_dies_or_fails_leaves_nothing_committed(ckpt, tmp_path, fault):
    """Process 1 SIGKILLs itself (or fails with ENOSPC) once it has written its first file: exit
    non-zero, one error line (a failure in its own words; a kill from process 0, torchrun's
    report naming the process), nothing at DST; the next write of DST runs and leaves no
    staging directory behind."""
    dst = str(tmp_path / "out")
    run = torchrun("reshard", ckpt, dst, "--world-size", "6", env={fault: "1"}, module="tests.cli.offline_faults")
    assert run.returncode != 0
    lines = error_lines(run)
    assert len(lines) == 1, failure(run)
    if fault == "MFSDP_TEST_FAIL_RANK":
        assert "No space left on device" in lines[0], lines
    else:
        assert "another process of the job" in lines[0], lines
    assert not os.path.exists(dst)
    single("reshard", ckpt, dst, "--world-size", "6")
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_a_refusal_every_process_reaches_is_said_once(ckpt, tmp_path):
    """A bad flag: every process refuses it alike; process 0 alone says so (--json: one object)."""
    run = torchrun("reshard", ckpt, str(tmp_path / "out"), "--world-size", "4", "--ep", "3", "--json")
    assert run.returncode != 0
    lines = [line for line in run.stderr.splitlines() if line.startswith("{")]
    assert len(lines) == 1 and "--ep 3" in json.loads(lines[0])["error"], failure(run)
    assert os.listdir(tmp_path) == []
