"""``--lora``'s spec: what parses (targets running to the next key, defaults), what is refused in
one line naming the part at fault, the record a checkpoint keeps, and the trainer's refusals
before anything is built: a family PEFT cannot adapt, ``--mxfp8`` beside it, a bad spec, targets
the model lacks or that are not linear layers (exit 1, one line, no checkpoint directory)."""

from __future__ import annotations

import pytest

from cli.lora import parse_lora
from cli.train import main
from mfsdp_ckpt.format.lora import LoraSpec, lora_of_record
from tests.hf_models import make_hf_dir


def test_a_spec_parses_with_targets_running_to_the_next_key():
    assert parse_lora("r=8,alpha=16,targets=q_proj,v_proj") == LoraSpec(8, 16.0, ("q_proj", "v_proj"), 0.0)
    spec = parse_lora(" targets = q_proj , k_proj,o_proj , dropout=0.05, alpha=0.5, r=2")
    assert spec == LoraSpec(2, 0.5, ("q_proj", "k_proj", "o_proj"), 0.05)
    assert str(spec) == "r=2,alpha=0.5,targets=q_proj,k_proj,o_proj,dropout=0.05"
    assert parse_lora(str(spec)) == spec
    assert lora_of_record({"lora": spec.to_record()}, "x") == spec
    assert lora_of_record({}, "x") is None


@pytest.mark.parametrize(
    "spec, why",
    [
        ("r=8,alpha=16", "--lora 'r=8,alpha=16': targets missing (e.g. r=8,alpha=16,targets=q_proj,v_proj)"),
        ("q_proj,r=8", "--lora 'q_proj,r=8': 'q_proj' is not key=value (e.g. r=8,alpha=16,targets=q_proj,v_proj)"),
        (
            "r=8,alpha=16,rank=4,targets=q",
            "--lora 'r=8,alpha=16,rank=4,targets=q': unknown key 'rank' (keys: r, alpha, targets, dropout)",
        ),
        ("r=8,r=4,alpha=1,targets=q", "--lora 'r=8,r=4,alpha=1,targets=q': r given twice"),
        ("r=0,alpha=16,targets=q", "--lora: r='0': expected a positive integer (the adapters' rank)"),
        ("r=2.5,alpha=16,targets=q", "--lora: r='2.5': expected a positive integer (the adapters' rank)"),
        ("r=8,alpha=-1,targets=q", "--lora: alpha='-1': expected a positive number (the scale is alpha / r)"),
        ("r=8,alpha=nan,targets=q", "--lora: alpha='nan': expected a positive number (the scale is alpha / r)"),
        ("r=8,alpha=1,targets=q,dropout=1", "--lora: dropout='1': expected a number in [0, 1)"),
        ("r=8,alpha=1,targets=", "--lora: targets: '' is not a module name (letters, digits, _)"),
        ("r=8,alpha=1,targets=q.proj", "--lora: targets: 'q.proj' is not a module name (letters, digits, _)"),
        ("r=8,alpha=1,targets=q,q", "--lora: targets: a module name is given twice"),
        (
            f"r={2**22},alpha=1,targets=q",
            f"--lora: r='{2**22}': more than 65536 (docs/lora.md: the adapters' rank is bounded)",
        ),
    ],
)
def test_a_bad_spec_is_named_in_one_line(spec, why):
    with pytest.raises(ValueError) as e:
        parse_lora(spec)
    assert str(e.value) == why


def test_a_record_that_is_not_one_is_named():
    with pytest.raises(ValueError, match=r"^ck: model_source.lora is not a JSON object$"):
        lora_of_record({"lora": [4]}, "ck")
    with pytest.raises(ValueError, match=r"^ck: model_source.lora: r=True: expected a positive integer"):
        lora_of_record({"lora": {"r": True, "alpha": 1, "targets": ["q"]}}, "ck")


def _refused(capsys, tmp_path, *args: str) -> str:
    ckpt = tmp_path / "ck"
    capsys.readouterr()
    assert main([*args, "--steps", "1", "--ckpt-dir", str(ckpt)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert not ckpt.exists()
    return err[len("error: ") :]


def test_the_trainer_refuses_before_building(capsys, tmp_path):
    lora = ("--lora", "r=4,alpha=8,targets=q_proj")
    assert _refused(capsys, tmp_path, "--model", "tiny", *lora) == (
        "--lora: only for transformers models (--hf-model), not mfsdp-gpt models: PEFT adapts nn.Linear modules, "
        "which the reference GPT's and Megatron-Core's layers are not"
    )
    assert _refused(capsys, tmp_path, "--model", "tiny", *lora, "--mxfp8", "e4m3") == (
        "--lora with --mxfp8: not supported (the frozen weights would be MXFP8 planes)"
    )
    assert _refused(capsys, tmp_path, "--model", "tiny", "--lora", "r=4") == (
        "--lora 'r=4': alpha, targets missing (e.g. r=8,alpha=16,targets=q_proj,v_proj)"
    )


def test_targets_must_be_linear_modules_of_the_model(capsys, tmp_path):
    llama = make_hf_dir(tmp_path / "llama", "llama")
    assert _refused(capsys, tmp_path, "--hf-model", llama, "--lora", "r=4,alpha=8,targets=q_proj,qproj") == (
        "--lora targets: LlamaForCausalLM has no module named 'qproj'"
    )
    assert _refused(capsys, tmp_path, "--hf-model", llama, "--lora", "r=4,alpha=8,targets=mlp") == (
        "--lora targets: model.layers.0.mlp (LlamaMLP) is not an nn.Linear (LoRA adapts linear layers)"
    )


def test_a_rank_over_a_targeted_layers_smaller_dimension_is_refused_before_any_adapter_is_made(capsys, tmp_path):
    """``r`` is at most the smaller dimension of every layer it adapts (docs/lora.md), checked on the
    model's meta copy before PEFT makes any adapter tensor (issue 65: ``r=2**22`` was accepted)."""
    llama = make_hf_dir(tmp_path / "llama", "llama")
    assert _refused(capsys, tmp_path, "--hf-model", llama, "--lora", "r=17,alpha=8,targets=q_proj,v_proj") == (
        "--lora: r=17 exceeds model.layers.0.self_attn.v_proj (32 in, 16 out): the rank is at most a targeted "
        "layer's smaller dimension, here 16"
    )


def test_a_bad_spec_in_a_config_file_names_the_file(capsys, tmp_path):
    config = tmp_path / "run.toml"
    config.write_text('[model]\nmodel = "tiny"\nlora = "r=4,alpha=8"\n')
    assert _refused(capsys, tmp_path, "--config", str(config)) == (
        f"--lora 'r=4,alpha=8': targets missing (e.g. r=8,alpha=16,targets=q_proj,v_proj) (set in {config})"
    )
