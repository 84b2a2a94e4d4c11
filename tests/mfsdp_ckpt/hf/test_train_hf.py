"""The bridge with the real trainer: a checkpoint trained on 3 gloo ranks exports to HF, and
``transformers`` computes our model's logits from the export; the export imported back trains on
2 ranks (after ``reshard`` for 2) with ``--init-from``, starting from exactly those weights (its first loss is the loss our
reference model computes on the same batch). A checkpoint for another model is refused."""

from __future__ import annotations

import json
import math
import subprocess

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from mfsdp_ckpt import hf
from mfsdp_ckpt.sharded.reshard import reshard
from mfsdp_core.data import SyntheticText
from tests.torchrun import failure, run_train

from .util import reference_model

TRAIN = ("--model", "tiny", "--batch-size", "12", "--seq-len", "32", "--log-every", "100")


def _train(nproc: int | None, *args: str) -> subprocess.CompletedProcess:
    return run_train(nproc, *TRAIN, *args)


def _losses(path) -> list[float]:
    return [json.loads(line)["loss"] for line in open(path) if line.strip()]


@pytest.mark.heavy
def test_trained_on_3_ranks_exports_and_trains_again_on_2_from_the_import(tmp_path):
    from transformers import AutoModelForCausalLM

    run = _train(3, "--steps", "20", "--ckpt-dir", str(tmp_path / "run"), "--save-every", "20")
    assert run.returncode == 0, failure(run)
    result = hf.export(tmp_path / "run" / "latest", tmp_path / "hf")
    assert result.architecture == "llama"

    ours = reference_model(str(tmp_path / "run" / "step_000020"))
    theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    x = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        err = (ours(x) - theirs(x).logits).abs().max().item()
    assert err <= 1e-5, err  # fp32, same math in another operation order

    hf.import_(tmp_path / "hf", tmp_path / "imported")
    # resharded for 2 ranks first: the import records the trainer's buffers, so each rank gets a file
    assert reshard(tmp_path / "imported", tmp_path / "imported_w2", world_size=2).files == 2
    run = _train(
        2, "--steps", "8", "--init-from", str(tmp_path / "imported_w2"), "--metrics", str(tmp_path / "m.jsonl")
    )
    assert run.returncode == 0, failure(run)
    assert "initialised from the weights of" in run.stdout
    losses = _losses(tmp_path / "m.jsonl")
    assert len(losses) == 8 and all(math.isfinite(v) for v in losses)
    batch = SyntheticText(256, 32, seed=0).batch(0, 12)
    with torch.no_grad():
        logits = reference_model(str(tmp_path / "imported"))(batch[:, :-1])
        expected = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)).item()
    # step 1's loss is computed before any update: the imported weights, sharded over 2 ranks
    assert abs(losses[0] - expected) <= 1e-5 * expected, (losses[0], expected)
    assert losses[0] < math.log(256) - 0.3  # trained weights, not a fresh init (~ln 256)

    # one process (no torchrun, which adds its own report): the error is one line
    refused = _train(None, "--steps", "2", "--init-from", str(tmp_path / "imported"), "--model", "tiny-moe")
    assert refused.returncode == 1
    assert refused.stderr.strip().count("\n") == 0, refused.stderr
    assert "error: --init-from: " in refused.stderr and "was written for another model config: " in refused.stderr
    both = _train(
        None, "--steps", "2", "--init-from", str(tmp_path / "imported"), "--resume", "--ckpt-dir", str(tmp_path / "x")
    )
    assert both.returncode == 1 and "--resume and --init-from exclude each other" in both.stderr
