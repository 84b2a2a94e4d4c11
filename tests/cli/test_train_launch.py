"""The trainer as a new user meets it: ``mfsdp-train --nproc-per-node N`` starts the ranks and a
failure is one line; Ctrl-C and SIGTERM stop every rank after the same step (SIGTERM saving it)
and ``--resume`` with only ``--ckpt-dir`` continues bitwise; a TOML config with overrides; the run
header; ``--help`` defaults and ``--version``; the trainer from any directory. Real processes."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.torchrun import ENV, ROOT, failure, read_metrics, start_in_own_session, train_cmd
from tests.torchrun import run_train as _run

TRAINER = [sys.executable, "-m", "mfsdp_cli.train"]  # what the mfsdp-train script runs
SMALL = ("--model", "tiny", "--batch-size", "6", "--seq-len", "32")


def _launch(tmp_path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """``mfsdp-train ARGS`` from a directory that is not the checkout."""
    return subprocess.run([*TRAINER, *args], cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=timeout)


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def test_a_refused_run_of_two_ranks_is_one_line(tmp_path):
    run = _launch(tmp_path, "--nproc-per-node", "2", *SMALL, "--batch-size", "5")
    assert run.returncode == 1, failure(run)
    assert _lines(run.stderr) == ["error: --batch-size 5 must be a multiple of world size x --micro-batches (2 x 1)"]


def test_a_flag_typo_is_one_line_with_a_suggestion_launched_or_under_torchrun(tmp_path):
    run = _launch(tmp_path, "--nproc-per-node", "2", "--model", "tiny", "--stpes", "3")
    assert run.returncode == 2, failure(run)
    assert _lines(run.stderr) == [
        "error: unrecognized arguments: --stpes 3 (--stpes: did you mean --steps?) (mfsdp-train --help lists the flags)"
    ]
    plain = _run(2, "--model", "tiny", "--stpes", "3")  # plain torchrun: each rank parses, rank 0 speaks
    assert plain.returncode != 0
    said = [line for line in plain.stderr.splitlines() if "unrecognized arguments" in line]
    assert said == [_lines(run.stderr)[0]], failure(plain)
    assert "usage:" not in plain.stderr


def _start(tmp_path, args: list[str], launched: bool = True) -> subprocess.Popen:
    cmd = [*TRAINER, "--nproc-per-node", "2", *args] if launched else train_cmd(2, *args)
    return start_in_own_session(cmd, tmp_path if launched else ROOT, ENV)


def _wait_for_step(metrics, step: int, proc: subprocess.Popen, timeout: float = 240.0) -> None:
    deadline = time.time() + timeout
    while max(read_metrics(metrics), default=0) < step:
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, "the run did not get going"
        time.sleep(0.02)


RUN = (*SMALL, "--steps", "400", "--save-every", "5", "--log-every", "1000")


@pytest.mark.heavy  # slow (the inner loop's 8 minutes); CI runs it
def test_ctrl_c_stops_every_rank_with_one_line_and_exit_130(tmp_path):
    ckpt, metrics = tmp_path / "run", tmp_path / "m.jsonl"
    proc = _start(tmp_path, [*RUN, "--ckpt-dir", str(ckpt), "--metrics", str(metrics)])
    _wait_for_step(metrics, 7, proc)
    os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the launcher's process group
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert _lines(err) == [], err
    last = _lines(out)[-1]
    match = re.fullmatch(
        r"interrupted at step (\d+); last checkpoint step_(\d+) \(committed\); continue with --resume", last
    )
    assert match, out
    step, saved = map(int, match.groups())
    assert step == max(read_metrics(metrics)) and saved == step - step % 5


@pytest.mark.heavy
def test_ctrl_c_under_plain_torchrun_leaves_no_rank_tracebacks(tmp_path):
    metrics = tmp_path / "m.jsonl"
    proc = _start(
        tmp_path, [*SMALL, "--steps", "400", "--log-every", "1000", "--metrics", str(metrics)], launched=False
    )
    _wait_for_step(metrics, 3, proc)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert "KeyboardInterrupt" not in err, err  # torchrun's own report of the signal may follow
    assert _lines(out)[-1].startswith("interrupted at step "), out
    assert "no --ckpt-dir, so there is no checkpoint to continue from" in out


PREEMPT = (*SMALL, "--steps", "40", "--save-every", "100", "--keep", "2", "--log-every", "1000")


@pytest.mark.heavy
def test_sigterm_saves_the_step_and_resume_with_only_the_ckpt_dir_continues_bitwise(tmp_path):
    """A scheduler's SIGTERM to the launcher: the step in flight finishes, is saved and committed;
    ``--resume`` with nothing but ``--ckpt-dir`` takes every other setting (--keep included) from
    the checkpoint, and the losses equal an uninterrupted run's."""
    ref = _run(2, *PREEMPT, "--ckpt-dir", str(tmp_path / "ref"), "--metrics", str(tmp_path / "ref.jsonl"))
    assert ref.returncode == 0, failure(ref)
    ckpt, metrics = tmp_path / "run", tmp_path / "m.jsonl"
    proc = _start(tmp_path, [*PREEMPT, "--ckpt-dir", str(ckpt), "--metrics", str(metrics)])
    _wait_for_step(metrics, 3, proc)
    os.kill(proc.pid, signal.SIGTERM)  # the launcher only: it passes the signal on to the ranks
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    stopped = max(read_metrics(metrics))
    assert 3 <= stopped < 40, "the run was not stopped mid-way"
    assert (
        _lines(out)[-1] == f"stopped by SIGTERM after step {stopped}: saved step_{stopped:06d}; continue with --resume"
    )
    assert _lines(err) == [], err
    assert (ckpt / f"step_{stopped:06d}" / "mfsdp.json").is_file()
    run = _launch(tmp_path, "--nproc-per-node", "2", "--ckpt-dir", str(ckpt), "--resume")
    assert run.returncode == 0, failure(run)
    assert f"resumed from {ckpt / f'step_{stopped:06d}'} at step {stopped}" in run.stdout
    assert "finished: step 40 of 40" in run.stdout
    ma, mb = read_metrics(tmp_path / "ref.jsonl"), read_metrics(metrics)
    assert [ma[s] for s in range(1, 41)] == [mb[s] for s in range(1, 41)]  # exact floats: bitwise
    assert sorted(p.name for p in ckpt.glob("step_*")) == [f"step_{stopped:06d}", "step_000040"]  # --keep 2 held


def test_resume_refuses_an_explicit_change_of_a_recorded_setting(tmp_path):
    ckpt = tmp_path / "run"
    first = _launch(tmp_path, *SMALL, "--steps", "4", "--stop-at", "2", "--ckpt-dir", str(ckpt), "--save-every", "2")
    assert first.returncode == 0, failure(first)
    run = _launch(tmp_path, "--ckpt-dir", str(ckpt), "--resume", "--seed", "7")
    assert run.returncode == 1
    assert _lines(run.stderr) == [
        f"error: --resume: {ckpt / 'step_000002'} was written with other settings: --seed 0 (this run: 7); "
        "pass --allow-change seed to resume with this run's values"
    ]


def test_a_toml_config_with_a_command_line_override(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text(
        '[model]\nmodel = "tiny"\n[training]\nsteps = 6\nbatch-size = 6\nseq_len = 32\nseed = 3\n'
        "[logging]\nlog-every = 1\n"
    )
    run = _launch(tmp_path, "--config", str(config), "--steps", "2", "--metrics", str(tmp_path / "m.jsonl"))
    assert run.returncode == 0, failure(run)
    assert "finished: step 2 of 2" in run.stdout
    assert "batch 6 x 32 tokens, 2 steps, seed 3" in run.stdout
    assert sorted(read_metrics(tmp_path / "m.jsonl")) == [1, 2]
    config.write_text("[training]\nsteps = 6\nbatch_szie = 6\n")
    bad = _launch(tmp_path, "--config", str(config))
    assert bad.returncode == 2
    assert _lines(bad.stderr) == [
        f"error: {config}: [training] batch_szie: not a trainer setting (did you mean batch_size?) "
        "(mfsdp-train --help lists the flags)"
    ]


def test_the_header_names_what_changes_the_maths(tmp_path):
    plain = _launch(tmp_path, *SMALL, "--steps", "1")
    assert plain.returncode == 0, failure(plain)
    assert "precision compute fp32; optimizer adamw (lr 0.003)" in plain.stdout
    assert "policy even\n" in plain.stdout
    run = _launch(tmp_path, *SMALL, "--steps", "1", "--mxfp8", "--dtype", "bf16", "--optimizer", "muon")
    assert run.returncode == 0, failure(run)
    assert "policy even, MXFP8 linear weights block(32)" in run.stdout
    assert "precision compute bf16 (main params, optimizer state, reductions fp32), MXFP8 e4m3 weights" in run.stdout
    assert "optimizer muon (lr 0.02, Newton-Schulz bfloat16) for hidden matrices, adamw (lr 0.003)" in run.stdout


@pytest.mark.parametrize("words", [["--help"], ["--version"]])
def test_help_shows_defaults_and_version_answers_from_any_directory(tmp_path, words):
    run = _launch(tmp_path, *words, timeout=120)
    assert run.returncode == 0, run.stderr
    if words == ["--help"]:
        text = " ".join(run.stdout.split())  # argparse wraps to the terminal's width
        assert "--steps STEPS total steps of the run (the LR schedule spans them) (default: 100)" in text
        assert "(default: optim_grads_params)" in text and " launch: --nproc-per-node N " in text
    else:
        assert re.fullmatch(r"mfsdp-train \d+\.\d+\.\d+\S*\n", run.stdout), run.stdout
