"""The command line as a user meets it, each through a real subprocess: ``--version``, a fast
``--help`` that lists every command with a whole sentence, ``ls`` of an empty directory, a
single ``.pt`` / ``.safetensors`` file given where a checkpoint directory is expected, and
errors as one line (one JSON object under ``--json``)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

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
    code = ("import sys\nfrom cli.main import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print('TORCH' if 'torch' in sys.modules else 'NO TORCH')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={"COLUMNS": "200", "PATH": ""})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("NO TORCH"), out.stdout
    listing = out.stdout.split("Commands:", 1)[1]
    for command in COMMANDS:
        line = re.search(rf"^\s+{re.escape(command)}\s+(.+)$", listing, re.MULTILINE)
        assert line, (command, listing)
        assert line.group(1).endswith(".") and "..." not in line.group(1), line.group(1)


def test_ls_of_an_empty_directory_says_so(tmp_path):
    out = _cli("ls", str(tmp_path))
    assert out.returncode == 0 and out.stdout.strip() == f"no checkpoints under {tmp_path}", out
    listed = _cli("ls", "--json", str(tmp_path))
    assert listed.returncode == 0 and json.loads(listed.stdout) == []


def test_a_single_file_is_named_with_the_command_that_takes_it(tmp_path):
    pt, st = tmp_path / "weights.pt", tmp_path / "model.safetensors"
    torch.save({"w": torch.ones(3)}, pt)
    safetensors.torch.save_file({"w": torch.ones(3)}, st)
    for command in ("inspect", "verify"):
        for path, kind in ((pt, "a torch.save file"), (st, "a safetensors file")):
            out = _cli(command, str(path))
            assert out.returncode == 1 and out.stdout == "", out
            assert out.stderr.count("\n") == 1, out.stderr
            assert out.stderr.startswith(f"error: {path}: {kind}, not a checkpoint directory; "
                                         f"'mfsdp-ckpt convert --to dcp {path} DST' makes a checkpoint of it"), out.stderr
    assert "import-hf" in _cli("inspect", str(st)).stderr


def test_errors_under_json_are_one_json_object(tmp_path):
    for args in (("inspect", "--json", str(tmp_path / "missing")), ("verify", "--json", str(tmp_path / "missing")),
                 ("ls", "--json", str(tmp_path / "missing"))):
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
    import os
    from importlib.metadata import entry_points

    scripts = {ep.name: ep.value for ep in entry_points(group="console_scripts") if ep.name.startswith("mfsdp-")}
    assert scripts == {"mfsdp-ckpt": "mfsdp_cli.main:main", "mfsdp-train": "mfsdp_cli.train:main"}
    script = os.path.join(os.path.dirname(sys.executable), "mfsdp-ckpt")
    out = subprocess.run([script, "ls", str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert out.returncode == 0 and out.stdout.strip() == f"no checkpoints under {tmp_path}", out
