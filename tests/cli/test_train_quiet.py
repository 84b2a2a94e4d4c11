"""A 2-rank ``mfsdp-train --nproc-per-node 2`` run of each model source (the reference GPT, a
genuine ``transformers`` model directory, a genuine Megatron-Core ``GPTModel``) prints the
trainer's own lines and nothing else: the header, one line per step, the save, the stop line; no
torchao ``.so`` load failures, no pytree enum warnings, no Transformer Engine / Apex / deprecation
warnings (``cli.quiet``). With ``--verbose`` the libraries' lines are back (one process suffices)."""

from __future__ import annotations

import json
import os
import re

import pytest

from tests.cli.test_train_mcore import ARGS as MCORE_ARGS  # the small MoE GPTModel those tests train
from tests.hf_models import make_hf_dir
from tests.torchao_ref import TORCHAO_DIR, with_torchao
from tests.torchrun import ENV, failure, run_train

#: every line a run of COMMON may print, in order (4 header lines, 2 steps, the save, the stop)
OURS = [
    r"model \S+ \((transformers|megatron-core)\)|model tiny, ",
    r"precision compute ",
    r"data synthetic, ",
    r"checkpoints: ",
    r"step +1 \| loss ",
    r"step +2 \| loss ",
    r"saved step_000002: ",
    r"finished: step 2 of 2$",
]
COMMON = ("--steps", "2", "--batch-size", "4", "--seq-len", "16", "--log-every", "1", "--save-every", "2")
#: a line each library prints when not silenced
THEIRS = {
    "hf": "torchao/_C_",  # torchao's .so load failures (and pytree's enum warnings)
    "mcore": "Transformer Engine and Apex are not installed",
}


def _source(kind: str, tmp_path) -> list[str]:
    """The model flags of ``kind``."""
    if kind == "tiny":
        return ["--model", "tiny"]
    if kind == "hf":
        return ["--hf-model", make_hf_dir(tmp_path / "qwen3", "qwen3")]
    path = tmp_path / "gpt.json"
    path.write_text(json.dumps(MCORE_ARGS))
    return ["--mcore-config", str(path)]


@pytest.mark.heavy
@pytest.mark.parametrize("kind", ["tiny", "hf", "mcore"])
def test_a_two_rank_run_prints_our_lines_only(kind, tmp_path):
    model = _source(kind, tmp_path)
    # torchao on the path (transformers then imports it, as in an environment that has it)
    assert os.path.isdir(TORCHAO_DIR), f"{TORCHAO_DIR}: missing (the Makefile installs torchao there)"
    env = with_torchao(ENV)
    run = run_train(None, "--nproc-per-node", "2", *model, *COMMON, "--ckpt-dir", str(tmp_path / "quiet"), env=env)
    assert run.returncode == 0, failure(run)
    assert run.stderr == "", run.stderr
    lines = run.stdout.splitlines()
    assert len(lines) == len(OURS) and all(re.match(p, line) for p, line in zip(OURS, lines)), run.stdout
    if kind in THEIRS:
        # a process of its own: what a library says while it is first imported is the point
        loud = run_train(
            None, *model, *COMMON, "--ckpt-dir", str(tmp_path / "loud"), "--verbose", env=env, launcher=True
        )
        assert loud.returncode == 0, failure(loud)
        assert THEIRS[kind] in loud.stderr, loud.stderr
        theirs = [line for line in (loud.stdout + loud.stderr).splitlines() if not any(re.match(p, line) for p in OURS)]
        assert theirs, loud.stdout + loud.stderr
