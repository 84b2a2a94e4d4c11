"""``cli.train --hf-model DIR --lora ...``: LoRA fine-tuning of genuine transformers models (Llama,
Qwen3-MoE with fused experts) through PEFT under our ``fully_shard``.

For each family: a 2-rank run stopped at step 3 and resumed at 3 ranks from the checkpoint alone
(no ``--hf-model``, no ``--lora``) equals an uninterrupted 2-rank run: steps 1-3 bitwise (same world
size, same math), steps 4-6 within 1e-6 relative (3 ranks sum the gradients in another order, so
the float sums differ in the last bits). The checkpoints hold the frozen weights bitwise as the
model directory has them, under the names the model without adapters uses, the adapters as
``…q_proj.lora_A.weight``, optimizer state for the adapters alone, and the adapters in the model
record. Other adapters on resume are refused in one line."""

from __future__ import annotations

import subprocess

import pytest
import torch
import transformers

from cli.train import main
from mfsdp_ckpt.read.manifest import read_manifest
from tests.hf_models import make_hf_dir
from tests.torchrun import failure, read_metrics, run_train

COMMON = ("--steps", "6", "--batch-size", "6", "--seq-len", "16", "--warmup", "2", "--log-every", "10")
LORA = ("--lora", "r=4,alpha=8,targets=q_proj,v_proj")
FAMILIES = ["llama", "qwen3_moe"]

pytestmark = pytest.mark.heavy


def _train(nproc: int | None, *args: str) -> subprocess.CompletedProcess:
    run = run_train(nproc, *COMMON, *args)
    assert run.returncode == 0, failure(run)
    return run


@pytest.fixture(scope="module", params=FAMILIES)
def trained(request, tmp_path_factory):
    """A model directory; an uninterrupted 2-rank LoRA run of it; the same stopped at step 3 and
    resumed at 3 ranks from the checkpoint alone."""
    family = request.param
    tmp = tmp_path_factory.mktemp(f"lora-{family}")
    source = make_hf_dir(tmp / "src", family)
    _train(2, "--hf-model", source, *LORA, "--metrics", str(tmp / "whole.jsonl"))
    ckpt = tmp / "ckpt"
    first = _train(
        2,
        "--hf-model",
        source,
        *LORA,
        "--stop-at",
        "3",
        "--ckpt-dir",
        str(ckpt),
        "--save-every",
        "3",
        "--metrics",
        str(tmp / "first.jsonl"),
    )
    resumed = _train(3, "--ckpt-dir", str(ckpt), "--resume", "--metrics", str(tmp / "then.jsonl"))
    return family, tmp, source, ckpt, first.stdout, resumed.stdout


def test_resume_at_three_ranks_equals_the_uninterrupted_run(trained):
    family, tmp, _, _, first_out, resumed_out = trained
    assert "trainable: LoRA r=4, alpha 8 on q_proj, v_proj; the rest frozen" in first_out
    assert "resumed from" in resumed_out and "trainable: LoRA r=4" in resumed_out
    first, then = read_metrics(tmp / "first.jsonl"), read_metrics(tmp / "then.jsonl")
    whole = read_metrics(tmp / "whole.jsonl")
    assert sorted({**first, **then}) == sorted(whole) == list(range(1, 7))
    assert all(first[s]["loss"] == whole[s]["loss"] for s in (1, 2, 3))
    worst = max(abs(then[s]["loss"] - whole[s]["loss"]) / abs(whole[s]["loss"]) for s in (4, 5, 6))
    print(f"{family} LoRA: 2 ranks, resumed at 3, vs 2 throughout: largest relative loss difference {worst:.2e}")
    assert worst <= 1e-6
    assert whole[6]["loss"] != whole[1]["loss"]  # the adapters did train


def test_the_checkpoint_holds_frozen_weights_as_given_and_state_for_the_adapters_only(trained):
    family, _, source, ckpt, _, _ = trained
    path = str(ckpt / "step_000006")
    manifest = read_manifest(path)
    assert manifest["model_source"]["lora"] == {"r": 4, "alpha": 8.0, "targets": ["q_proj", "v_proj"], "dropout": 0.0}
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    flat = ckpt / "flat.pt"
    dcp_to_torch_save(path, str(flat))  # stock PyTorch reads it
    state = torch.load(flat, weights_only=True)
    model = {k[len("model.") :]: v for k, v in state.items() if k.startswith("model.")}
    loaded = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)  # experts fused
    given = {n: p.detach() for n, p in loaded.named_parameters()}
    adapters = {k for k in model if ".lora_" in k}
    assert adapters == {
        f"model.layers.{i}.self_attn.{m}.lora_{ab}.weight"
        for i in range(2)
        for m in ("q_proj", "v_proj")
        for ab in "AB"
    }
    assert sorted(set(model) - adapters) == sorted(given)  # the base's names, nothing more
    for name, tensor in given.items():
        assert torch.equal(model[name], tensor), name  # frozen: as the directory has it
    assert any(model[k].abs().sum() > 0 for k in adapters if ".lora_B." in k)  # B starts at zero, trained since
    optim = {k for k in state if k.startswith("optim.") and k != "optim.param_groups"}
    assert optim and all(".lora_" in k for k in optim), sorted(k for k in optim if ".lora_" not in k)[:5]


def test_other_adapters_on_resume_are_refused_in_one_line(trained, capsys):
    _, _, _, ckpt, _, _ = trained
    capsys.readouterr()
    assert main([*COMMON, "--ckpt-dir", str(ckpt), "--resume", "--lora", "r=8,alpha=8,targets=q_proj"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == (
        f"error: --lora r=8,alpha=8,targets=q_proj: --resume: {ckpt}/step_000006 was trained with LoRA "
        "r=4,alpha=8,targets=q_proj,v_proj (the adapters of a checkpoint cannot change when resuming or starting "
        "from it)"
    ), err
