"""The command line as a user meets it, each through a real subprocess: ``--version``, a fast
``--help`` that lists every command with a whole sentence, ``ls`` of an empty directory, a
single ``.pt`` / ``.safetensors`` file given where a checkpoint directory is expected, and
errors as one line (one JSON object under ``--json``)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import safetensors.torch
import torch

COMMANDS = ["convert", "diff", "export-hf", "import-hf", "inspect", "ls", "reshard", "verify"]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli.main", *args], capture_output=True, text=True, timeout=300)


def test_version():
    from importlib.metadata import version

    out = _cli("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"mfsdp-ckpt {version('mfsdp-ckpt')}", out


def test_help_lists_every_command_with_a_sentence_and_imports_no_torch():
    code = (
        "import sys\nfrom cli.main import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print('TORCH' if 'torch' in sys.modules else 'NO TORCH')"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env={"COLUMNS": "200", "PATH": ""}
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("NO TORCH"), out.stdout
    listing = out.stdout.split("Commands:", 1)[1]
    from cli.main import main

    assert set(COMMANDS) <= set(main.commands)
    for command in sorted(main.commands):  # every command, those added later too
        line = re.search(rf"^\s+{re.escape(command)}\s+(.+)$", listing, re.MULTILINE)
        assert line, (command, listing)
        assert line.group(1).endswith(".") and "..." not in line.group(1), line.group(1)


def test_ls_of_an_empty_directory_says_so(tmp_path):
    out = _cli("ls", str(tmp_path))
    assert out.returncode == 0 and out.stdout.strip() == f"no checkpoints under {tmp_path}", out
    listed = _cli("ls", "--json", str(tmp_path))
    assert listed.returncode == 0 and json.loads(listed.stdout) == []


@pytest.mark.heavy
def test_a_single_file_is_named_with_the_command_that_takes_it(tmp_path):
    pt, st = tmp_path / "weights.pt", tmp_path / "model.safetensors"
    torch.save({"w": torch.ones(3)}, pt)
    safetensors.torch.save_file({"w": torch.ones(3)}, st)
    for command in ("inspect", "verify"):
        for path, kind in ((pt, "a torch.save file"), (st, "a safetensors file")):
            out = _cli(command, str(path))
            assert out.returncode == 1 and out.stdout == "", out
            assert out.stderr.count("\n") == 1, out.stderr
            assert out.stderr.startswith(
                f"error: {path}: {kind}, not a checkpoint directory; "
                f"'mfsdp-ckpt convert --to dcp {path} DST' makes a checkpoint of it"
            ), out.stderr
    assert "import-hf" in _cli("inspect", str(st)).stderr


@pytest.mark.heavy
def test_errors_under_json_are_one_json_object(tmp_path):
    for args in (
        ("inspect", "--json", str(tmp_path / "missing")),
        ("verify", "--json", str(tmp_path / "missing")),
        ("ls", "--json", str(tmp_path / "missing")),
    ):
        out = _cli(*args)
        assert out.returncode == 1 and out.stdout == "", out
        lines = out.stderr.splitlines()
        assert len(lines) == 1, out.stderr
        error = json.loads(lines[0])
        assert set(error) == {"error", "kind"} and error["kind"] == "NotACheckpointError", error
        assert str(tmp_path / "missing") in error["error"]
    plain = _cli("inspect", str(tmp_path / "missing"))
    assert plain.returncode == 1 and plain.stderr.startswith("error: ") and plain.stderr.count("\n") == 1


def test_installed_under_its_own_import_name(tmp_path):
    """The command line package is installed as ``mfsdp_cli`` (a top-level ``cli`` would clash
    with other packages): the console scripts name it, and they run from any directory."""
    from importlib.metadata import entry_points

    scripts = {ep.name: ep.value for ep in entry_points(group="console_scripts") if ep.name.startswith("mfsdp-")}
    assert scripts == {"mfsdp-ckpt": "mfsdp_cli.main:main", "mfsdp-train": "mfsdp_cli.train:main"}
    script = os.path.join(os.path.dirname(sys.executable), "mfsdp-ckpt")
    out = subprocess.run(
        [script, "ls", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    assert out.returncode == 0 and out.stdout.strip() == f"no checkpoints under {tmp_path}", out


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory) -> str:
    """A real checkpoint of the trainer (one process, one step), in a run directory of its own."""
    from tests.torchrun import failure, run_train

    root = tmp_path_factory.mktemp("tiny") / "run"
    run = run_train(None, "--steps", "1", "--batch-size", "2", "--seq-len", "16", "--ckpt-dir", str(root))
    assert run.returncode == 0, failure(run)
    return str(root / "step_000001")


@pytest.mark.heavy
def test_json_field_names_are_shared_across_commands(tiny_ckpt, tmp_path):
    """``path`` names what a command read or wrote, ``ok`` is the verdict of a check (verify,
    diff), ``bytes`` a size (reshard, ls, export-hf, import-hf), ``tensors`` a count."""
    ckpt = tiny_ckpt
    verify = json.loads(_cli("verify", "--json", ckpt).stdout)
    assert verify["path"] == ckpt and verify["ok"] is True and verify["faults"] == []
    same = _cli("diff", "--json", ckpt, ckpt)
    assert same.returncode == 0 and json.loads(same.stdout)["ok"] is True
    reshard = _cli("reshard", "--json", ckpt, str(tmp_path / "w3"), "--world-size", "3")
    assert reshard.returncode == 0, reshard.stderr
    info = json.loads(reshard.stdout)
    assert info["path"] == str(tmp_path / "w3") and info["bytes"] > 0 and "bytes_written" not in info
    listed = json.loads(_cli("ls", "--json", os.path.dirname(ckpt)).stdout)
    assert [e["name"] for e in listed] == ["step_000001"] and listed[0]["bytes"] > 0
    inspected = json.loads(_cli("inspect", "--json", ckpt).stdout)
    assert inspected["path"] == ckpt
    exported = _cli("export-hf", "--json", ckpt, str(tmp_path / "hf"))
    assert exported.returncode == 0, exported.stderr
    exported = json.loads(exported.stdout)
    assert {"path", "tensors", "bytes", "seconds"} <= set(exported)
    imported = json.loads(_cli("import-hf", "--json", str(tmp_path / "hf"), str(tmp_path / "back")).stdout)
    assert {"path", "tensors", "bytes", "seconds"} <= set(imported)
    differ = _cli("diff", "--json", ckpt, str(tmp_path / "back"))  # the import has no optimizer state
    assert differ.returncode == 1 and json.loads(differ.stdout)["ok"] is False
    converted = json.loads(_cli("convert", "--json", ckpt, str(tmp_path / "flat.pt"), "--to", "torch").stdout)
    assert converted["path"] == str(tmp_path / "flat.pt")


@pytest.mark.heavy  # slow (the inner loop's 8 minutes); CI runs it
def test_a_destination_that_cannot_be_written_is_one_line_and_leaves_nothing(tiny_ckpt, tmp_path):
    ckpt = tiny_ckpt
    (tmp_path / "afile").write_text("not a directory")
    before = sorted(os.listdir(tmp_path))
    for args in (
        ("reshard", ckpt, str(tmp_path / "afile" / "out"), "--world-size", "2"),
        ("export-hf", ckpt, str(tmp_path / "afile" / "hf")),
        ("convert", ckpt, str(tmp_path / "afile" / "flat.safetensors"), "--to", "safetensors"),
    ):
        out = _cli(*args)
        assert out.returncode == 1 and out.stdout == "" and out.stderr.count("\n") == 1, (args, out)
        assert out.stderr.startswith("error: ") and str(tmp_path / "afile") in out.stderr, (args, out.stderr)
        assert "internal error" not in out.stderr, out.stderr
    assert sorted(os.listdir(tmp_path)) == before and (tmp_path / "afile").read_text() == "not a directory"


@pytest.mark.heavy
def test_s3_without_credentials_or_bucket_is_one_line(tiny_ckpt, tmp_path, s3_bucket):
    """Against the local S3 server: no credentials anywhere (environment, profile files; the
    instance-metadata lookup off), and a bucket that does not exist."""
    ckpt = tiny_ckpt
    no_credentials = {
        k: v for k, v in os.environ.items() if not k.startswith("AWS_ACCESS") and not k.startswith("AWS_SECRET")
    }
    no_credentials.update(
        AWS_EC2_METADATA_DISABLED="true",
        AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"),
        AWS_CONFIG_FILE=str(tmp_path / "none"),
    )
    for args in (
        ("verify", f"{s3_bucket}/x"),
        ("reshard", ckpt, f"{s3_bucket}/out", "--world-size", "2"),
        ("ls", "--json", s3_bucket),
    ):
        out = subprocess.run(
            [sys.executable, "-m", "cli.main", *args], capture_output=True, text=True, timeout=300, env=no_credentials
        )
        assert out.returncode == 1 and out.stderr.count("\n") == 1, (args, out)
        assert "no S3 credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY" in out.stderr, (
            args,
            out.stderr,
        )
    missing = _cli("reshard", ckpt, "s3://no-such-bucket-here/out", "--world-size", "2")
    assert missing.returncode == 1 and missing.stderr.count("\n") == 1, missing
    assert missing.stderr.startswith("error: s3://no-such-bucket-here/out: s3://no-such-bucket-here does not exist")
    import fsspec

    assert not fsspec.filesystem("s3", skip_instance_cache=True).exists(f"{s3_bucket}/out")
