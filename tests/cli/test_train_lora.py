"""``cli.train --hf-model DIR --lora ...``: LoRA fine-tuning of genuine transformers models (Llama,
Qwen3-MoE with fused experts) through PEFT under our ``fully_shard``.

For each family: a 2-rank run stopped at step 3 and resumed at 3 ranks from the checkpoint alone
(no ``--hf-model``, no ``--lora``) equals an uninterrupted 2-rank run: steps 1-3 bitwise (same world
size, same math), steps 4-6 within 1e-6 relative (3 ranks sum the gradients in another order, so
the float sums differ in the last bits). The checkpoints hold the frozen weights bitwise as the
model directory has them (in the base the saves reference; read with stock DCP, the save holds
none of them), under the names the model without adapters uses, the adapters as
``…q_proj.lora_A.weight``, optimizer state for the adapters alone, and the adapters in the model
record. Exports: merged (transformers loads it; each weight bitwise PEFT's own merge, logits within
1e-5) and the adapters alone (PEFT loads them on the base model; logits bitwise the trained
model's). ``--init-from`` a checkpoint without adapters loads every weight it holds and starts
the adapters fresh. Other adapters on resume are refused in one line, as is an adapter export of
a checkpoint without adapters."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
import transformers

from cli.lora_source import checkpoint_name
from cli.train import main
from mfsdp_ckpt.format.manifest import manifest_checksum
from mfsdp_ckpt.read.manifest import read_manifest
from tests.hf_models import make_hf_dir
from tests.torchrun import ENV, ROOT, failure, read_metrics, run_train

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

    save, base = _stock_parts(ckpt / "step_000006", ckpt / "flat")
    assert base and not set(save) & set(base)
    assert all(".lora_" in k for k in save if k.startswith("model.")), "a frozen weight written again"
    state = {**save, **base}
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


def _stock_parts(ckpt, scratch) -> tuple[dict, dict]:
    """What stock PyTorch reads of a checkpoint (``dcp_to_torch_save``): the save's own entries,
    and the base's it references (the frozen weights; empty when it references none)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    parts = []
    reference = read_manifest(str(ckpt)).get("base")
    for i, part in enumerate((ckpt, ckpt.parent / reference["name"] if reference else None)):
        if part is None:
            parts.append({})
            continue
        dcp_to_torch_save(str(part), f"{scratch}-{i}.pt")
        parts.append(torch.load(f"{scratch}-{i}.pt", weights_only=True))
    return parts[0], parts[1]


def _stock_state(ckpt, scratch) -> dict:
    """Every entry of a checkpoint as stock PyTorch reads it: the save's and its base's."""
    save, base = _stock_parts(ckpt, scratch)
    return {**save, **base}


def _trained_model(source: str, state: dict) -> torch.nn.Module:
    """The run's model as the checkpoint holds it: the base class with PEFT's adapters, every
    tensor taken from the checkpoint (as stock DCP reads it) under its canonical name."""
    import peft

    model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    model = peft.inject_adapter_in_model(peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]), model)
    canonical = {n: checkpoint_name(n) for n, _ in model.named_parameters()}
    result = model.load_state_dict({n: state[f"model.{c}"] for n, c in canonical.items()}, strict=False)
    assert not result.unexpected_keys and all("rotary" in k for k in result.missing_keys), result
    return model.eval()


def _cli(*args: str) -> subprocess.CompletedProcess:
    run = subprocess.run([sys.executable, "-m", "cli.main", *args], cwd=ROOT, env=ENV, capture_output=True, text=True)
    return run


def test_exports_merged_for_transformers_and_adapters_for_peft(trained):
    """The merged export loads in transformers with the trained model's logits (within 1e-5
    relative: ``W + s B A`` rounds once where the adapted layer adds two products), each merged
    weight bitwise as PEFT's own ``merge()`` makes it; the adapter export loads in PEFT on the base
    model with the trained model's logits bitwise."""
    import peft

    family, tmp, source, ckpt, _, _ = trained
    trained_model = _trained_model(source, _stock_state(ckpt / "step_000006", tmp / "flat-export"))
    tokens = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = trained_model(tokens).logits

    merged_dir, adapter_dir = tmp / "merged", tmp / "adapter"
    assert (run := _cli("export-hf", str(ckpt / "latest"), str(merged_dir))).returncode == 0, run.stderr
    merged = transformers.AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        got = merged(tokens).logits
    worst = ((got - want).abs().max() / want.abs().max()).item()
    print(f"{family}: merged export vs the trained model: {worst:.2e} of the largest logit")
    assert worst <= 1e-5
    for module in trained_model.modules():  # PEFT's own merge of the same tensors
        if isinstance(module, peft.tuners.lora.LoraLayer):
            module.merge()
    peft_merged = {n.replace(".base_layer", ""): p for n, p in trained_model.named_parameters() if ".lora_" not in n}
    exported = dict(merged.named_parameters())
    assert sorted(exported) == sorted(peft_merged)
    assert all(torch.equal(exported[n], peft_merged[n]) for n in exported), family

    assert (run := _cli("export-hf", str(ckpt / "latest"), str(adapter_dir), "--adapter")).returncode == 0, run.stderr
    assert sorted(p.name for p in adapter_dir.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    base = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    adapted = peft.PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    with torch.no_grad():
        assert torch.equal(adapted(tokens).logits, want)


@pytest.mark.parametrize("damage", ["deleted", "altered"])
def test_a_save_whose_base_is_gone_or_changed_is_refused_by_every_export(trained, tmp_path, damage):
    """The frozen weights live in the base the saves reference: without it (or with another manifest
    under its name) ``verify``, ``export-hf`` and ``export-hf --adapter`` each refuse in one line
    naming it, and write nothing."""
    family, _, _, ckpt, _, _ = trained
    run = tmp_path / "run"
    shutil.copytree(ckpt, run, symlinks=True)
    base = run / read_manifest(str(run / "step_000006"))["base"]["name"]
    if damage == "deleted":
        shutil.rmtree(base)
    else:  # a field of its manifest changed, its checksum made anew: no longer the base referenced
        manifest = json.loads((base / "mfsdp.json").read_text())
        manifest["step"] = 7
        manifest["manifest_crc32c"] = manifest_checksum(manifest)
        (base / "mfsdp.json").write_text(json.dumps(manifest))
    for args in (("verify",), ("export-hf",), ("export-hf", "--adapter")):
        out = tmp_path / f"out-{len(args)}-{args[-1]}"
        command = (args[0], str(run / "latest"), *([str(out)] if args[0] == "export-hf" else []), *args[1:])
        refused = _cli(*command)
        lines = refused.stderr.strip().splitlines()
        assert refused.returncode != 0 and len(lines) == 1 and base.name in lines[0], (family, args, refused.stderr)
        assert not out.exists()


def test_adapter_export_of_a_checkpoint_without_adapters_is_refused(tmp_path):
    source = make_hf_dir(tmp_path / "src", "llama")
    ckpt = tmp_path / "ckpt"
    _train(1, "--hf-model", source, "--ckpt-dir", str(ckpt), "--steps", "1")
    run = _cli("export-hf", str(ckpt / "latest"), str(tmp_path / "adapter"), "--adapter")
    assert run.returncode == 1
    assert run.stderr.strip() == (
        f"error: {ckpt}/latest: no LoRA adapters to export (its model_source records none; export-hf without "
        "--adapter writes the model)"
    ), run.stderr
    assert not (tmp_path / "adapter").exists()


def test_init_from_a_checkpoint_without_adapters_starts_them_fresh(tmp_path):
    """``--init-from`` a full fine-tuning run's checkpoint: every weight it holds is loaded (the
    frozen ones stay as it has them), the adapters it lacks start as PEFT initialises them; the
    same checkpoint is refused for ``--resume`` (its optimizer state would not match)."""

    source = make_hf_dir(tmp_path / "src", "llama")
    full, tuned = tmp_path / "full", tmp_path / "tuned"
    _train(1, "--hf-model", source, "--ckpt-dir", str(full), "--steps", "2")
    run = _train(2, "--init-from", str(full / "latest"), *LORA, "--ckpt-dir", str(tuned), "--steps", "2")
    assert "8 adapter tensors it does not hold start fresh" in run.stdout, run.stdout
    states = {}
    for name, ckpt in (("full", full / "step_000002"), ("tuned", tuned / "step_000002")):
        states[name] = _stock_state(ckpt, tmp_path / name)
    base = {k: v for k, v in states["full"].items() if k.startswith("model.")}
    tuned_model = {k: v for k, v in states["tuned"].items() if k.startswith("model.")}
    assert sorted(set(tuned_model) - set(base)) == sorted(k for k in tuned_model if ".lora_" in k) and len(base) > 0
    assert all(torch.equal(tuned_model[k], v) for k, v in base.items())  # frozen since the init: bitwise
    refused = run_train(2, *COMMON, "--resume", str(full / "latest"), *LORA, "--ckpt-dir", str(tmp_path / "r"))
    assert refused.returncode != 0 and "was written for another model config: lora=None" in refused.stderr
