"""``mfsdp-train --tensorboard DIR`` (issue 51, item 14): a 2-rank run stopped with ``--stop-at``
and resumed from an earlier checkpoint into the same DIR reads back, through TensorBoard's own
event reader, as one unbroken curve per scalar equal to the ``--metrics`` lines; without the
tensorboard package the flag is refused in one line before any rank starts."""

from __future__ import annotations

import json
import os
import struct
import sys

import pytest

from tests.torchrun import failure, run_train

STEPS, STOP, SAVE_EVERY = 8, 5, 2


def _float32(x: float) -> float:
    """``x`` as TensorBoard stores a scalar (a 32-bit float)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def _metrics(path) -> list[dict]:
    return [json.loads(line) for line in open(path, encoding="utf-8")]


@pytest.mark.heavy  # two 2-rank runs: 45 s on 2 shared CPUs
def test_a_resumed_run_appends_to_one_unbroken_curve(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ckpt, tb = tmp_path / "ckpt", tmp_path / "tb"
    common = ("--model", "tiny", "--steps", str(STEPS), "--ckpt-dir", str(ckpt), "--tensorboard", str(tb))
    first = run_train(
        2, *common, "--stop-at", str(STOP), "--save-every", str(SAVE_EVERY), "--metrics", str(tmp_path / "m1")
    )
    assert first.returncode == 0, failure(first)
    # resumed from step 4 although the first try reached step 5: step 5 is trained (and written) again
    again = run_train(2, *common, "--resume", str(ckpt / "step_000004"), "--metrics", str(tmp_path / "m2"))
    assert again.returncode == 0, failure(again)
    assert len(os.listdir(tb)) == 2  # one event file per run, in the same DIR

    acc = EventAccumulator(str(tb), size_guidance={"scalars": 0})
    acc.Reload()
    m1, m2 = _metrics(tmp_path / "m1"), _metrics(tmp_path / "m2")
    assert [m["step"] for m in m1] == [1, 2, 3, 4, 5] and [m["step"] for m in m2] == [5, 6, 7, 8]
    want = {m["step"]: m for m in m1 + m2}  # the resumed run's step 5 replaces the first try's
    for tag, field in (("train/loss", "loss"), ("train/lr", "lr"), ("train/grad_norm", "grad_norm")):
        events = acc.Scalars(tag)
        assert [e.step for e in events] == list(range(1, STEPS + 1)), tag  # each step once, in order
        assert [e.value for e in events] == [_float32(want[s][field]) for s in range(1, STEPS + 1)], tag
    for tag in ("train/tokens_per_s", "train/step_time_s"):
        events = acc.Scalars(tag)
        assert [e.step for e in events] == list(range(1, STEPS + 1)) and all(e.value > 0 for e in events), tag
    # a point per committed save, at its step: the first try's step-5 save is purged with its step
    saves = {e.step: e.value for e in acc.Scalars("checkpoint/size_bytes")}
    assert sorted(saves) == [2, 4, 6, 8]
    for step, size in saves.items():
        manifest = json.loads((ckpt / f"step_{step:06d}" / "mfsdp.json").read_text())
        assert size == manifest["total_bytes"]
    assert [e.step for e in acc.Scalars("checkpoint/save_time_s")] == [2, 4, 6, 8]


def test_without_the_package_the_flag_is_one_line_before_any_rank(tmp_path, monkeypatch, capsys):
    from cli.train import main
    from cli.train_args import UsageError, check_flags, parse_args
    from cli.train_tensorboard import MISSING

    monkeypatch.setitem(sys.modules, "tensorboard", None)  # `import tensorboard` raises ImportError
    tb = tmp_path / "tb"
    argv = ["--model", "tiny", "--steps", "1", "--tensorboard", str(tb)]
    assert main(["--nproc-per-node", "2", *argv]) == 1  # the launcher: no rank started
    err = capsys.readouterr().err
    assert err == f"error: {MISSING}\n" and "--tensorboard" in err and "pip install" in err
    with pytest.raises(UsageError, match="--tensorboard needs the tensorboard package"):
        check_flags(parse_args(argv), 1)  # what every rank checks first, too
    assert not tb.exists()
