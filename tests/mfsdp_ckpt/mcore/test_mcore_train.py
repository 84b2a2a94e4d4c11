"""Training starts from an imported Megatron-Core checkpoint at another world size: the MoE
fixture (saved by MCore at world size 2, EP 2) imported for 3 ranks trains there with
``--init-from``; its first loss (before any update) is the loss our model computes on the same
batch with the imported weights, which equal MCore's (test_mcore.py checks the logits)."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
import torch.nn.functional as F

from mfsdp_ckpt.mcore import import_mcore
from mfsdp_core.data import SyntheticText
from tests.torchrun import failure, run_train

from .test_mcore import fixture, our_model


@pytest.mark.heavy
def test_training_starts_from_an_imported_mcore_checkpoint_on_3_ranks(tmp_path):
    result = import_mcore(fixture("moe_ep2"), tmp_path / "w3", world_size=3, config=fixture("moe_ep2") + ".config.json")
    assert len([n for n in os.listdir(result.path) if n.endswith(".distcp")]) == 3
    run = run_train(
        3,
        "--steps",
        "4",
        "--batch-size",
        "6",
        "--seq-len",
        "16",
        "--log-every",
        "100",
        "--init-from",
        result.path,
        "--metrics",
        str(tmp_path / "m.jsonl"),
    )
    assert run.returncode == 0, failure(run)
    losses = [json.loads(line)["loss"] for line in open(tmp_path / "m.jsonl") if line.strip()]
    assert len(losses) == 4 and all(math.isfinite(v) for v in losses)
    batch = SyntheticText(64, 16, seed=0).batch(0, 6)
    with torch.no_grad():
        logits = our_model(result.path)(batch[:, :-1])
        expected = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)).item()
    assert abs(losses[0] - expected) <= 1e-5 * expected, (losses[0], expected)
