"""LoRA runs of a Llama of realistic size (over a million parameters, almost all frozen) go on from
their checkpoints: ``--resume`` at the same world size (losses bitwise those of the uninterrupted
run) and at another (within 1e-6 relative: 3 ranks sum the gradients in another order), and
``--init-from`` (every weight the checkpoint holds, adapters included, loaded bitwise). Such a
save holds only the adapters and their optimizer state (a few hundred KiB); the frozen weights are
in the base it references, which the model-size guard of the start checkpoint counts too (it used
to count the save's own bytes alone and refused every model larger than them).

The trainer runs on the test harness's warm ranks (:mod:`tests.warm_train`)."""

from __future__ import annotations

import shutil

import pytest
import torch

from mfsdp_ckpt.read.manifest import read_manifest
from tests.cli.test_train_lora import _stock_parts
from tests.hf_models import make_hf_dir
from tests.torchrun import failure, read_metrics
from tests.warm_train import warm_train

COMMON = ("--steps", "6", "--batch-size", "6", "--seq-len", "16", "--warmup", "2", "--log-every", "10")
LORA = ("--lora", "r=4,alpha=8,targets=q_proj,v_proj")
#: a Llama of 1.14M parameters: hidden 128, 6 layers (the tests' other Llamas have 30K)
SIZE = dict(hidden_size=128, intermediate_size=352, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2)

pytestmark = pytest.mark.heavy  # five 2- and 3-rank LoRA runs of transformers' Llama (about 45 s)


def _train(world: int, *args: str):
    run = warm_train(world, *COMMON, *args)
    assert run.returncode == 0, failure(run)
    return run


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory):
    """A 1.14M-parameter Llama directory, an uninterrupted 2-rank LoRA run of it, and the same
    run stopped at step 3 (saved there)."""
    tmp = tmp_path_factory.mktemp("lora-llama-1m")
    source = make_hf_dir(tmp / "src", "llama", **SIZE)
    _train(2, "--hf-model", source, *LORA, "--metrics", str(tmp / "whole.jsonl"))
    ckpt = tmp / "ckpt"
    first = _train(2, "--hf-model", source, *LORA, "--stop-at", "3", "--save-every", "3", "--ckpt-dir", str(ckpt))
    return tmp, source, ckpt, first.stdout


def test_the_model_is_realistic_and_its_save_far_smaller_than_it(llama_run):
    tmp, _, ckpt, first_out = llama_run
    assert "1,142,912 parameters (10,752 trainable" in first_out, first_out
    manifest = read_manifest(str(ckpt / "step_000003"))
    base = read_manifest(str(ckpt / manifest["base"]["name"]))
    assert manifest["total_bytes"] < 1_142_912 < manifest["total_bytes"] + base["total_bytes"]


@pytest.mark.parametrize("world", [2, 3])
def test_resume_goes_on_as_the_uninterrupted_run(llama_run, tmp_path, world):
    tmp, _, ckpt, _ = llama_run
    run = tmp_path / "run"
    shutil.copytree(ckpt, run, symlinks=True)
    resumed = _train(world, "--ckpt-dir", str(run), "--resume", "--metrics", str(tmp_path / "then.jsonl"))
    assert f"resumed from {run}/step_000003 at step 3 (world size {world})" in resumed.stdout, resumed.stdout
    then, whole = read_metrics(tmp_path / "then.jsonl"), read_metrics(tmp / "whole.jsonl")
    assert sorted(then) == [4, 5, 6]
    if world == 2:  # the same math in the same order: bitwise
        assert [then[s]["loss"] for s in then] == [whole[s]["loss"] for s in then]
    else:
        worst = max(abs(then[s]["loss"] - whole[s]["loss"]) / abs(whole[s]["loss"]) for s in then)
        assert worst <= 1e-6, worst


def test_init_from_loads_every_weight_adapters_included(llama_run, tmp_path):
    """``--init-from`` the LoRA checkpoint at learning rate 0: the weights never move, so the new
    run's save holds every model weight of the checkpoint it started from, bitwise."""
    _, _, ckpt, _ = llama_run
    out = tmp_path / "init"
    run = _train(
        2, "--init-from", str(ckpt / "latest"), "--lr", "0", "--min-lr", "0", "--steps", "1", "--ckpt-dir", str(out)
    )
    assert f"initialised from the weights of {ckpt}/step_000003" in run.stdout, run.stdout
    given = {k: v for part in _stock_parts(ckpt / "step_000003", tmp_path / "given") for k, v in part.items()}
    got = {k: v for part in _stock_parts(out / "step_000001", tmp_path / "got") for k, v in part.items()}
    weights = sorted(k for k in given if k.startswith("model."))
    assert weights == sorted(k for k in got if k.startswith("model.")) and any(".lora_B." in k for k in weights)
    assert all(torch.equal(given[k], got[k]) for k in weights)
