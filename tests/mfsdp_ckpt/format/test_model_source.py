"""The manifest's ``model_source``: what a checkpoint's weights belong to. ``save`` records it (a
reference GPT's when only ``model_config`` is given), ``inspect`` shows it, older manifests read as
``mfsdp-gpt``, and the schema refuses a kind no tool knows."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

import mfsdp_ckpt
from cli.main import main
from mfsdp_ckpt.errors import CorruptCheckpointError
from mfsdp_ckpt.format.manifest_schema import check_manifest
from mfsdp_ckpt.format.model_source import describe_source, model_source_of
from mfsdp_ckpt.read.manifest import read_manifest
from mfsdp_ckpt.tools.inspect import inspect_checkpoint
from tests.mfsdp_ckpt.util import build

HF_RECORD = {
    "kind": "transformers",
    "class": "LlamaForCausalLM",
    "config": {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 32},
}


def _save_both(root: str) -> None:
    model, optim = build("optim_grads_params", "even")
    mfsdp_ckpt.save(f"{root}/gpt", model, optim, model_config={"num_layers": 1, "hidden_size": 32})
    mfsdp_ckpt.save(f"{root}/hf", model, optim, model_source=HF_RECORD)


def test_save_records_the_source_and_inspect_shows_it(ranks, tmp_path):
    ranks(_save_both, 2, str(tmp_path))
    gpt = read_manifest(str(tmp_path / "gpt"))
    assert gpt["model_source"] == {"kind": "mfsdp-gpt", "config": {"num_layers": 1, "hidden_size": 32}}
    assert read_manifest(str(tmp_path / "hf"))["model_source"] == HF_RECORD
    assert inspect_checkpoint(tmp_path / "hf").to_json()["model_source"] == HF_RECORD
    out = CliRunner().invoke(main, ["inspect", str(tmp_path / "hf")])
    assert out.exit_code == 0, out.output
    assert "source      transformers LlamaForCausalLM (llama, 2 layers, hidden 32)" in out.output
    out = CliRunner().invoke(main, ["inspect", str(tmp_path / "gpt"), "--json"])
    assert json.loads(out.output)["model_source"]["kind"] == "mfsdp-gpt"


def test_older_manifests_and_unknown_kinds():
    assert model_source_of({"model_config": {"num_layers": 2}}) == {"kind": "mfsdp-gpt", "config": {"num_layers": 2}}
    assert model_source_of({"model_config": None}) is None and describe_source(None) == "unknown"
    assert (
        describe_source(
            {
                "kind": "megatron-core",
                "args": {"num_layers": 2, "hidden_size": 64, "num_experts": 4},
                "layer_spec": "local",
            }
        )
        == "megatron-core GPTModel (local spec, 2 layers, hidden 64, 4 experts)"
    )
    base = {"format": "mfsdp-ckpt", "chunks": {}}
    check_manifest({**base, "model_source": HF_RECORD}, "m")
    with pytest.raises(
        CorruptCheckpointError,
        match=r"m: field 'model_source.kind': keras is not one of mfsdp-gpt, "
        r"megatron-core, transformers",
    ):
        check_manifest({**base, "model_source": {"kind": "keras"}}, "m")
    with pytest.raises(CorruptCheckpointError, match=r"field 'model_source.kind': missing"):
        check_manifest({**base, "model_source": {"class": "X"}}, "m")


def test_lora_adapters_in_the_record():
    lora = {"r": 4, "alpha": 8.0, "targets": ["q_proj", "v_proj"], "dropout": 0.0}
    chunk = {"file": "__0_0.distcp", "offset": 0, "length": 1, "crc32c": 0}
    factors = {f"model.l.{t}.lora_{f}.weight": chunk for t in ("q_proj", "v_proj") for f in "AB"}
    base = {"format": "mfsdp-ckpt", "chunks": factors}
    check_manifest({**base, "model_source": {**HF_RECORD, "lora": lora}}, "m")
    with pytest.raises(CorruptCheckpointError, match=r"field 'model_source.lora': model_source records LoRA"):
        check_manifest({**base, "chunks": {}, "model_source": {**HF_RECORD, "lora": lora}}, "m")  # no adapters
    assert describe_source({**HF_RECORD, "lora": lora}).endswith(", LoRA r=4,alpha=8,targets=q_proj,v_proj")
    assert describe_source({**HF_RECORD, "lora": {"r": 0}}).endswith(", LoRA (model_source.lora does not parse)")
    with pytest.raises(CorruptCheckpointError, match=r"field 'model_source.lora.r'"):
        check_manifest({**base, "model_source": {**HF_RECORD, "lora": {**lora, "r": 0}}}, "m")
    with pytest.raises(CorruptCheckpointError, match=r"field 'model_source.lora.targets'"):
        check_manifest({**base, "model_source": {**HF_RECORD, "lora": {**lora, "targets": "q_proj"}}}, "m")


def test_transformers_models_are_recognised_without_importing_transformers():
    import torch
    import transformers

    from mfsdp_ckpt.format.model_source import transformers_source
    from tests.hf_models import hf_config

    assert transformers_source(torch.nn.Linear(2, 2)) is None
    fake = torch.nn.Linear(2, 2)
    fake.config = type("C", (), {"model_type": "llama"})()  # not a transformers class: not recorded
    assert transformers_source(fake) is None
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config("qwen3"))
    record = transformers_source(model)
    assert record["kind"] == "transformers" and record["class"] == "Qwen3ForCausalLM"
    assert record["config"]["architectures"] == ["Qwen3ForCausalLM"] and record["config"]["tie_word_embeddings"] is True
    json.dumps(record)  # fit for the manifest
