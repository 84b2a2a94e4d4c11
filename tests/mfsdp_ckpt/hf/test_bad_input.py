"""Bad input to the bridge fails with one ConversionError (a CheckpointError) naming the key or
field at fault, before anything is written, and leaves nothing at the destination (not even a
temporary sibling)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

pytest.importorskip("transformers")

import mfsdp_ckpt
from mfsdp_ckpt import hf
from mfsdp_ckpt.errors import CheckpointExistsError, ConversionError
from mfsdp_ckpt.write.builder import CheckpointBuilder
from mfsdp_ckpt.write.manifest import write_manifest
from mfsdp_core.models.gpt import PRESETS, GPTModel

from .util import hf_config, random_hf_model, save_hf


def _nothing_at(path) -> bool:
    parent, name = os.path.split(os.path.abspath(path))
    return not os.path.exists(path) and not any(n.startswith(f".{name}.") for n in os.listdir(parent))


@pytest.fixture
def llama_dir(tmp_path):
    return save_hf(random_hf_model(hf_config("llama")), str(tmp_path / "src"))


def _edit_tensors(hf_dir: str, fn) -> None:
    path = os.path.join(hf_dir, "model.safetensors")
    tensors = load_file(path)
    fn(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def _edit_config(hf_dir: str, **changes) -> None:
    path = os.path.join(hf_dir, "config.json")
    config = json.loads(open(path).read())
    config.update(changes)
    open(path, "w").write(json.dumps(config))


def test_unknown_architecture(llama_dir, tmp_path):
    _edit_config(llama_dir, model_type="gpt2", architectures=["GPT2LMHeadModel"])
    with pytest.raises(
        ConversionError,
        match=r"unknown architecture \(model_type='gpt2'.*known: deepseek_v3, llama, mixtral, qwen2, qwen3, qwen3_moe, qwen3_next",
    ):
        hf.import_(llama_dir, tmp_path / "ckpt")
    with pytest.raises(ConversionError, match="unknown architecture 'gpt2'"):
        hf.import_(llama_dir, tmp_path / "ckpt", arch="gpt2")
    assert _nothing_at(tmp_path / "ckpt")


def test_arch_flag_that_contradicts_config(llama_dir, tmp_path):
    with pytest.raises(ConversionError, match="config.json says model_type 'llama', --arch says 'qwen3'"):
        hf.import_(llama_dir, tmp_path / "ckpt", arch="qwen3")


@pytest.mark.parametrize(
    "arch,changes,message",
    [
        ("llama", dict(attention_bias=True), "attention_bias=true"),
        ("llama", dict(hidden_act="gelu"), "hidden_act='gelu'"),
        (
            "llama",
            dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}),
            "rope_type='linear'",
        ),
        ("qwen2", dict(use_sliding_window=True), "use_sliding_window=true"),
        ("mixtral", dict(sliding_window=16), "sliding_window=16"),
        ("qwen3_moe", dict(mlp_only_layers=[1]), r"mlp_only_layers=\[1\]"),
        ("qwen3_moe", dict(decoder_sparse_step=2), "decoder_sparse_step=2"),
    ],
)
def test_config_the_mapping_cannot_express(arch, changes, message, tmp_path):
    src = save_hf(random_hf_model(hf_config(arch)), str(tmp_path / "src"))
    _edit_config(src, **changes)
    with pytest.raises(ConversionError, match=f"{arch} config cannot be expressed by our model: .*{message}"):
        hf.import_(src, tmp_path / "ckpt")
    assert _nothing_at(tmp_path / "ckpt")


def test_missing_unexpected_and_misshapen_tensors_are_all_named(llama_dir, tmp_path):
    def damage(t):
        del t["model.layers.1.mlp.up_proj.weight"]
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
        t["model.layers.0.self_attn.k_proj.weight"] = torch.ones(8, 32)

    _edit_tensors(llama_dir, damage)
    with pytest.raises(ConversionError) as e:
        hf.import_(llama_dir, tmp_path / "ckpt")
    msg = str(e.value)
    assert "\n" not in msg
    assert "missing tensors: model.layers.1.mlp.up_proj.weight" in msg
    assert "unexpected tensors (no mapping in llama): model.layers.0.self_attn.rotary_emb.inv_freq" in msg
    assert "shape mismatch: model.layers.0.self_attn.k_proj.weight (file (8, 32), config (16, 32))" in msg
    assert _nothing_at(tmp_path / "ckpt")


def test_tied_model_with_an_lm_head_is_an_unexpected_tensor(tmp_path):
    src = save_hf(random_hf_model(hf_config("qwen3", tie_word_embeddings=True)), str(tmp_path / "src"))
    _edit_tensors(src, lambda t: t.__setitem__("lm_head.weight", torch.zeros(96, 32)))
    with pytest.raises(ConversionError, match="unexpected tensors .*lm_head.weight"):
        hf.import_(src, tmp_path / "ckpt")


def test_index_naming_the_wrong_file(tmp_path):
    src = save_hf(random_hf_model(hf_config("llama")), str(tmp_path / "src"), max_shard_size="40KB")
    index_path = os.path.join(src, "model.safetensors.index.json")
    index = json.loads(open(index_path).read())
    files = sorted(set(index["weight_map"].values()))
    key = next(k for k, f in index["weight_map"].items() if f == files[0])
    index["weight_map"][key] = files[1]
    open(index_path, "w").write(json.dumps(index))
    with pytest.raises(ConversionError, match=f"not in the file the index names: {key}"):
        hf.import_(src, tmp_path / "ckpt")


def _write_checkpoint(path, config, edit=None):
    torch.manual_seed(0)
    state = {f"model.{k}": v.detach() for k, v in GPTModel(config).named_parameters()}
    if edit:
        edit(state)
    manifest = {
        "writer": {"world_size": 1, "buffers": [], "groups": []},
        "model_config": config.to_dict(),
        "step": None,
        "include_grads": False,
        "has_optimizer": False,
        "versions": {},
    }
    with CheckpointBuilder(path, manifest) as b:
        for k, v in state.items():
            b.add_tensor(k, v)
        b.commit()
    return str(path)


def test_export_of_a_config_no_architecture_expresses(tmp_path):
    ckpt = _write_checkpoint(tmp_path / "ckpt", PRESETS["tiny-moe"])
    with pytest.raises(ConversionError, match="no known architecture can express .*mixtral: a shared expert"):
        hf.export(ckpt, tmp_path / "out")
    with pytest.raises(ConversionError, match="cannot be expressed as qwen3_moe: .*qk_layernorm=False"):
        hf.export(ckpt, tmp_path / "out", arch="qwen3_moe")
    with pytest.raises(ConversionError, match="unknown architecture 'bert'"):
        hf.export(ckpt, tmp_path / "out", arch="bert")
    assert _nothing_at(tmp_path / "out")


def test_export_names_missing_unexpected_and_misshapen_keys(tmp_path):
    def damage(state):
        del state["model.decoder.layers.1.mlp.linear_fc2.weight"]
        state["model.decoder.layers.0.extra.weight"] = torch.zeros(2)
        state["model.output_layer.weight"] = torch.zeros(3, 64)

    ckpt = _write_checkpoint(tmp_path / "ckpt", PRESETS["tiny"], damage)
    with pytest.raises(ConversionError) as e:
        hf.export(ckpt, tmp_path / "out")
    msg = str(e.value)
    assert "missing from the checkpoint: model.decoder.layers.1.mlp.linear_fc2.weight" in msg
    assert "not in the model config (no HF name): model.decoder.layers.0.extra.weight" in msg
    assert "shape mismatch: model.output_layer.weight (checkpoint (3, 64), model config (256, 64))" in msg
    assert _nothing_at(tmp_path / "out")


def test_export_without_model_config_and_existing_destination(tmp_path):
    ckpt = _write_checkpoint(tmp_path / "ckpt", PRESETS["tiny"])
    manifest_path = os.path.join(ckpt, "mfsdp.json")
    manifest = json.loads(open(manifest_path).read())
    os.makedirs(tmp_path / "out")
    with pytest.raises(CheckpointExistsError, match="already exists"):
        hf.export(ckpt, tmp_path / "out")
    hf.export(ckpt, tmp_path / "out", overwrite=True)
    assert os.path.isfile(tmp_path / "out" / "config.json")
    manifest["model_config"] = None
    write_manifest(ckpt, manifest)  # checksummed again, as a writer would: the manifest itself is sound
    with pytest.raises(ConversionError, match="the manifest has no model_config"):
        hf.export(ckpt, tmp_path / "out2")


def test_a_corrupt_chunk_mid_export_leaves_nothing(tmp_path):
    ckpt = _write_checkpoint(tmp_path / "ckpt", PRESETS["tiny"])
    size = os.path.getsize(os.path.join(ckpt, "__0_0.distcp"))
    with open(os.path.join(ckpt, "__0_0.distcp"), "r+b") as f:  # flip a byte near the end
        f.seek(size - 100)
        byte = f.read(1)
        f.seek(size - 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(mfsdp_ckpt.CorruptCheckpointError):
        hf.export(ckpt, tmp_path / "out", max_shard_size="50KB")
    assert _nothing_at(tmp_path / "out")
