"""No output over, into or around an input (issue 52, cause 6): ``inspect --html`` / ``diff --html``
/ ``--png``, ``reshard --plan-from``, ``convert`` through a ``latest`` pointer, the config files
``export-hf`` and ``import-mcore`` read, and the trainer's ``--ckpt-dir``, ``--metrics`` and
``--tensorboard``. Each refusal is one line naming the flag and the input, a non-zero exit, and
every input byte-identical afterwards (hashed); the normal flows (a run resumed from a checkpoint
inside its ``--ckpt-dir``, a report beside the run) stay allowed.

The library and CLI cases run in-process (``CliRunner``); the trainer's through its launcher,
which refuses before any rank starts."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess

import pytest
from click.testing import CliRunner

import mfsdp_ckpt
from cli.main import main
from tests.mfsdp_ckpt.util import build, train_steps
from tests.torchrun import ENV, ROOT, failure, train_cmd

TRAIN = ("--model", "tiny", "--steps", "2", "--batch-size", "4", "--seq-len", "16")


def _tree(root: str) -> dict[str, str]:
    """Every entry under ``root``: a file's sha256, a link's target, a directory's mark."""
    out = {}
    for d, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(d, name)
            rel = os.path.relpath(path, root)
            if os.path.islink(path):
                out[rel] = "-> " + os.readlink(path)
            elif os.path.isfile(path):
                with open(path, "rb") as f:
                    out[rel] = hashlib.sha256(f.read()).hexdigest()
            else:
                out[rel] = "dir"
    return out


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory) -> str:
    """A run directory: ``step_1``, ``step_2`` (latest), written in this process."""
    root = str(tmp_path_factory.mktemp("outputs") / "run")
    model, optim = build("optim_grads_params", "row")
    for step in (1, 2):
        train_steps(model, optim, step - 1, step)
        mfsdp_ckpt.save(os.path.join(root, f"step_{step}"), model, optim, extra={"step": step}, step=step)
    return root


@pytest.fixture
def run(saved_run, tmp_path_factory) -> str:
    """A copy of the run of its own for each test (a writer that does destroy an input spoils no
    other test's)."""
    root = str(tmp_path_factory.mktemp("inputs") / "run")
    shutil.copytree(saved_run, root, symlinks=True)
    return root


class Unchanged:
    """The run and ``tmp`` (where refused outputs would go) hashed after :meth:`settle` (a test's
    own set-up done), checked unchanged at the end of the test."""

    def __init__(self, tmp, run: str) -> None:
        self.tmp, self.run = tmp, run
        self.settle()

    def settle(self) -> None:
        self.before = _tree(self.run), _tree(str(self.tmp))

    def check(self) -> None:
        assert (_tree(self.run), _tree(str(self.tmp))) == self.before


@pytest.fixture
def world(run, tmp_path):
    """``Unchanged(tmp_path, run)``, checked after the test."""
    guard = Unchanged(tmp_path, run)
    yield guard
    guard.check()


def _refused(args: list[str], flag: str, names: str) -> None:
    """``mfsdp-ckpt ARGS`` fails with one line naming ``flag`` and the input ``names``."""
    res = CliRunner().invoke(main, args)
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.exit_code == 1, (res.exit_code, res.output)
    assert len(lines) == 1 and lines[0].startswith(f"error: {flag}") and names in lines[0], res.stderr


# ---- reports: inspect --html / diff --html / --png ------------------------------------------------


def _report_cases(tmp: str, run: str) -> list[tuple[list[str], str, str]]:
    s1, s2 = os.path.join(run, "step_1"), os.path.join(run, "step_2")
    manifest = os.path.join(s2, "mfsdp.json")
    os.symlink(manifest, os.path.join(tmp, "link.html"))
    os.makedirs(os.path.join(tmp, "d"))
    return [  # (argv, flag, the input the line names)
        (["inspect", s2, "--html", os.path.join(s2, "mfsdp.json")], "--html", s2),
        (["inspect", s2, "--html", os.path.join(s2, "__0_0.distcp")], "--html", s2),
        (["inspect", run, "--html", os.path.join(run, "latest")], "--html", os.path.join(run, "latest")),
        (["inspect", os.path.join(run, "latest"), "--html", os.path.join(s2, "mfsdp.json")], "--html", s2),
        (["inspect", s2, "--html", s2], "--html", s2),  # the checkpoint directory itself
        (["inspect", s2, "--html", run], "--html", s2),  # a directory holding it
        (["inspect", s2, "--html", os.path.join(s2, "new.html")], "--html", s2),  # a new file inside it
        (["inspect", s2, "--html", os.path.join(tmp, "link.html")], "--html", s2),  # a link to its manifest
        (["inspect", s2, "--html", os.path.join(tmp, "d", "..", os.path.relpath(manifest, tmp))], "--html", s2),
        (["inspect", s2, "--png", os.path.join(s2, "mfsdp.json")], "--png", s2),
        (["diff", s1, s2, "--html", os.path.join(s2, "mfsdp.json")], "--html", s2),
        (["diff", s1, s2, "--html", os.path.join(s1, "__0_0.distcp")], "--html", s1),
    ]


def test_a_report_never_writes_over_into_or_around_the_checkpoint_it_reads(world):
    tmp, run = world.tmp, world.run
    cases = _report_cases(str(tmp), run)
    world.settle()
    for args, flag, names in cases:
        _refused(args, flag, names)


def test_a_report_refuses_a_link_a_fifo_or_a_directory(world):
    tmp, run = world.tmp, world.run
    step = os.path.join(run, "step_2")
    os.mkfifo(tmp / "fifo")
    (tmp / "elsewhere.html").write_text("mine")
    os.symlink(tmp / "elsewhere.html", tmp / "link.html")
    (tmp / "dir").mkdir()
    world.settle()
    _refused(["inspect", step, "--html", str(tmp / "fifo")], "--html", "is not a regular file")
    _refused(["inspect", step, "--html", str(tmp / "link.html")], "--html", "is a symbolic link")
    _refused(["inspect", step, "--html", str(tmp / "dir")], "--html", "is a directory")
    _refused(["inspect", step, "--html", str(tmp / "p.html"), "--png", str(tmp / "p.html")], "--png", "--html")


def test_a_report_beside_the_run_is_written(run, tmp_path):
    before = _tree(os.path.join(run, "step_2"))
    res = CliRunner().invoke(main, ["inspect", run, "--html", str(tmp_path / "page.html")])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "page.html").read_text().startswith("<!DOCTYPE html>")
    assert _tree(os.path.join(run, "step_2")) == before


# ---- writers' other inputs: --plan-from, a latest pointer, config files -----------------------------


def test_reshard_never_writes_over_or_into_its_plan_from(world):
    run = world.run
    s1, s2 = os.path.join(run, "step_1"), os.path.join(run, "step_2")
    base = ["reshard", s2, "--world-size", "2", "--plan-from", s1]
    _refused(base[:2] + [os.path.join(s1, "sub")] + base[2:], s1, "the --plan-from checkpoint")
    _refused(base[:2] + [s1] + base[2:] + ["--overwrite"], s1, "the --plan-from checkpoint")


def test_convert_through_latest_never_writes_into_the_checkpoint(world):
    run = world.run
    out = os.path.join(run, "step_2", "x.pt")
    _refused(["convert", os.path.join(run, "latest"), out, "--to", "torch"], out, "lies inside the source")


def test_a_config_file_is_never_replaced_with_the_output(world):
    tmp = world.tmp
    out = tmp / "out"
    out.mkdir()
    (out / "args.json").write_text("{}")
    (out / "config.json").write_text("{}")
    world.settle()
    missing = str(tmp / "no-such-src")  # refused before the source is read
    _refused(
        ["import-mcore", missing, str(out), "--config", str(out / "args.json"), "--overwrite"], str(out), "--config"
    )
    _refused(
        ["export-hf", missing, str(out), "--model-config", str(out / "config.json"), "--overwrite"],
        str(out),
        "--model-config",
    )


# ---- the trainer: refused by the launcher, before any rank starts ------------------------------------


def _train(*args: str) -> subprocess.CompletedProcess:
    cmd = train_cmd(None, "--nproc-per-node", "2", *TRAIN, *args)
    return subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)


def test_trainer_outputs_never_over_or_inside_its_inputs(world):
    tmp, run = world.tmp, world.run
    step = os.path.join(run, "step_2")
    (tmp / "train.bin").write_bytes(bytes(4096))
    world.settle()
    cases = [  # first the one today's main runs (appending the metrics to the token file)
        (["--data", str(tmp / "train.bin"), "--metrics", str(tmp / "train.bin")], "--metrics", "the --data file"),
        (["--ckpt-dir", step, "--resume", step], "--ckpt-dir", "is the --resume checkpoint"),
        (["--ckpt-dir", os.path.join(step, "sub"), "--resume", run], "--ckpt-dir", "lies inside the --resume"),
        (
            ["--ckpt-dir", str(tmp / "r"), "--resume", step, "--metrics", os.path.join(step, "mfsdp.json")],
            "--metrics",
            step,
        ),
        (["--ckpt-dir", run, "--resume", "--metrics", os.path.join(run, "latest")], "--metrics", "--resume"),
        (
            ["--ckpt-dir", str(tmp / "r"), "--init-from", run, "--metrics", os.path.dirname(run)],
            "--metrics",
            "contains",
        ),
        (["--init-from", step, "--ckpt-dir", os.path.join(step, "r")], "--ckpt-dir", "the --init-from checkpoint"),
        (
            ["--init-from", run, "--tensorboard", os.path.join(step, "tb")],
            "--tensorboard",
            "the --init-from checkpoint",
        ),
    ]
    for args, flag, names in cases:
        res = _train(*args)
        lines = [line for line in res.stderr.splitlines() if line.strip()]
        assert res.returncode == 1 and len(lines) == 1, failure(res)
        assert lines[0].startswith(f"error: {flag} ") and names in lines[0], res.stderr
    assert not (tmp / "r").exists()


def test_trainer_keeps_its_normal_flows(run, tmp_path):
    """A run resumed from a checkpoint inside its --ckpt-dir (by path, by run directory, or
    ``latest``), metrics and events beside its checkpoints, a token file kept in the run directory:
    the flags are accepted (checked in-process, as the launcher checks them)."""
    from cli.train_args import check_flags, parse_args

    step = os.path.join(run, "step_2")
    with open(os.path.join(tmp_path, "train.bin"), "wb") as f:
        f.write(bytes(4096))
    for args in (
        ["--ckpt-dir", run, "--resume", step, "--metrics", os.path.join(run, "metrics.jsonl")],
        ["--ckpt-dir", run, "--resume"],
        ["--ckpt-dir", run, "--resume", run, "--tensorboard", run],
        ["--ckpt-dir", str(tmp_path), "--data", str(tmp_path / "train.bin"), "--metrics", str(tmp_path / "m.jsonl")],
        ["--ckpt-dir", str(tmp_path / "new"), "--init-from", run],
    ):
        check_flags(parse_args([*TRAIN, *args]), 1)
