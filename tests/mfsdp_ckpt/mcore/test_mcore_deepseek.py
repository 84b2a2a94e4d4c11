"""The DeepSeek-V3 family through ``import-mcore`` / ``export-mcore``, on genuine Megatron-Core
0.16.1 checkpoints (fixtures/mcore/deepseek and deepseek_local, written by
fixtures/mcore/generate_deepseek.py: multi-latent attention with YaRN, one dense layer then MoE
layers with a shared expert, sigmoid routing with an expert bias, groups and a scaling factor,
one MTP layer; stored one entry per layer, as MCore stores layers that differ).

Tolerance of the logit comparisons: 1e-5 of the largest logit (fp32). Ours and MCore's compute
the same math in other orders (unfused attention vs SDPA, the experts' sums), so bitwise equality
is not expected; measured: ~1.5e-7 of it (main and MTP logits). The fixture is built so that a
wrong mapping shows: every norm and expert bias is randomised, and dropping the groups, the
expert bias or the scaling factor moves the logits by 1.7e-2 to 4e-2 of the largest, YaRN's
stretch or its mscale_all_dim by 1.5e-4 to 3.5e-4 (:func:`test_the_fixture_tells_the_routing_and_rope_apart`).

The tests marked ``mcore_env`` run Megatron-Core (this environment's, or ``MFSDP_MCORE_PYTHON``'s):
its ``dist_checkpointing.load`` of our exports, strictly, then its logits."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from mfsdp_ckpt.errors import ConversionError
from mfsdp_ckpt.mcore import export_mcore, import_mcore
from mfsdp_ckpt.mcore.source import McoreSource
from mfsdp_ckpt.read.reader import CheckpointReader
from mfsdp_core.models.config import get_preset
from mfsdp_core.models.gpt import GPTConfig, GPTModel
from mfsdp_core.models.mtp import shift_left
from tests.torchrun import failure, run_train

from .test_mcore import stock_read
from .test_mcore_inputs import write_mcore

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
FIXTURES = os.path.join(ROOT, "fixtures", "mcore")
GENERATOR = os.path.join(FIXTURES, "generate_deepseek.py")
CONFIG = os.path.join(FIXTURES, "deepseek.config.json")
PYTHON = os.environ.get("MFSDP_MCORE_PYTHON") or sys.executable
RELATIVE_TOL = 1e-5


def fixture(name: str) -> str:
    return os.path.join(FIXTURES, name)


def recorded() -> dict[str, torch.Tensor]:
    return torch.load(fixture("deepseek.logits.pt"), weights_only=True)


def our_model(ckpt) -> GPTModel:
    with CheckpointReader(ckpt) as reader:
        model = GPTModel(GPTConfig.from_dict(reader.manifest["model_config"]))
        model.load_state_dict({k[len("model.") :]: reader.read(k) for k in reader.keys() if k.startswith("model.")})
    return model.eval()


def logits_and_mtp(model: GPTModel, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Our main logits and every MTP depth's logits (``[D, b, s, V]``, depth k at position t
    predicting token t + k + 2), as MCore's output layer gives them."""
    with torch.no_grad():
        hidden = model.decoder(model.embedding(tokens))
        out, shifted = [], tokens
        for layer in model.mtp.layers:
            shifted = shift_left(shifted)
            hidden = layer(hidden, model.embedding(shifted))
            out.append(model.head(hidden))
        return model(tokens), torch.stack(out)


def relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return (ours - theirs).abs().max().item() / theirs.abs().max().item()


@pytest.mark.parametrize("name", ["deepseek", "deepseek_local"])
def test_import_gives_mcores_logits_and_mtp_logits(name, tmp_path):
    result = import_mcore(fixture(name), tmp_path / "ckpt", config=CONFIG)
    assert result.step == 7 and result.assumed == []
    cfg = result.model_config
    want = dict(
        multi_latent_attention=True,
        num_attention_heads=2,
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_head_dim=12,
        qk_pos_emb_head_dim=8,
        v_head_dim=4,
        first_k_dense_replace=1,
        num_experts=8,
        moe_router_enable_expert_bias=True,
        moe_router_num_groups=2,
        moe_router_group_topk=1,
        moe_router_topk_scaling_factor=2.5,
        moe_score_func="sigmoid",
        rope_type="yarn",
        rotary_scaling_factor=4.0,
        mscale_all_dim=0.8,
        mtp_num_layers=1,
    )
    assert {k: cfg[k] for k in want} == want
    rec = recorded()
    logits, mtp = logits_and_mtp(our_model(tmp_path / "ckpt"), rec["tokens"])
    assert relative_error(logits, rec["logits"]) <= RELATIVE_TOL
    assert relative_error(mtp, rec["mtp_logits"]) <= RELATIVE_TOL
    with CheckpointReader(tmp_path / "ckpt") as reader:
        bias = reader.read("model.decoder.layers.1.mlp.router.expert_bias")
        assert bias.dtype == torch.float32 and bias.shape == (8,) and bias.abs().max() > 0
        assert "model.mtp.layers.0.transformer_layer.self_attention.linear_q_up_proj.layer_norm_weight" in reader.keys()
        assert "model.decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in reader.keys()
        assert "model.decoder.layers.1.pre_mlp_layernorm.weight" in reader.keys()


def test_both_spellings_import_to_the_same_tensors(tmp_path):
    import_mcore(fixture("deepseek"), tmp_path / "te", config=CONFIG)
    import_mcore(fixture("deepseek_local"), tmp_path / "local", config=CONFIG)
    with CheckpointReader(tmp_path / "te") as a, CheckpointReader(tmp_path / "local") as b:
        keys = [k for k in a.keys() if k.startswith("model.")]
        assert keys == [k for k in b.keys() if k.startswith("model.")] and len(keys) == 105
        for key in keys:
            assert torch.equal(a.read(key), b.read(key)), key


def test_the_shapes_alone_give_every_mla_dimension(tmp_path):
    """Without arguments: the heads and MLA dimensions come from the shapes; RoPE and the routing
    come from MCore's defaults (named); an expert bias implies sigmoid routing."""
    result = import_mcore(fixture("deepseek"), tmp_path / "ckpt")
    cfg = result.model_config
    assert (cfg["num_attention_heads"], cfg["qk_head_dim"], cfg["v_head_dim"], cfg["qk_pos_emb_head_dim"]) == (
        2,
        12,
        4,
        8,
    )
    assert cfg["moe_score_func"] == "sigmoid" and cfg["rope_type"] == "yarn" and cfg["rotary_scaling_factor"] == 40.0
    for name in ("rope_type", "rotary_scaling_factor", "moe_router_num_groups", "moe_router_topk_scaling_factor"):
        assert name in result.assumed


@pytest.mark.parametrize(
    "src, moe_norm, expected",
    [
        ("deepseek", "te", "deepseek"),
        ("deepseek_local", "local", "deepseek_local"),
        ("deepseek", "local", "deepseek_local"),
        ("deepseek_local", "te", "deepseek"),
    ],
)
def test_round_trip_is_bitwise_per_tensor(src, moe_norm, expected, tmp_path):
    """MCore -> canonical -> export-mcore gives back MCore's checkpoint entry for entry (tensors
    bitwise, _extra_state objects, common state), in either spec's names."""
    import_mcore(fixture(src), tmp_path / "ckpt", config=CONFIG)
    export_mcore(tmp_path / "ckpt", tmp_path / "back", moe_norm=moe_norm)
    original, back = stock_read(fixture(expected)), stock_read(str(tmp_path / "back"))
    assert sorted(original) == sorted(back)
    for key, value in original.items():
        if isinstance(value, torch.Tensor):
            assert value.dtype == back[key].dtype and torch.equal(value, back[key]), key
        else:
            assert value == back[key], key
    with McoreSource.open(tmp_path / "back") as b:
        assert b.common == {"iteration": 7}
    again = import_mcore(tmp_path / "back", tmp_path / "again")  # its mcore_args.json gives the config
    with CheckpointReader(tmp_path / "ckpt") as reader:
        assert again.assumed == [] and again.model_config == reader.manifest["model_config"]


def test_import_at_world_size_2_gives_the_same_logits(tmp_path):
    result = import_mcore(fixture("deepseek"), tmp_path / "w2", world_size=2, config=CONFIG)
    rec = recorded()
    logits, mtp = logits_and_mtp(our_model(result.path), rec["tokens"])
    assert relative_error(logits, rec["logits"]) <= RELATIVE_TOL
    assert relative_error(mtp, rec["mtp_logits"]) <= RELATIVE_TOL


@pytest.mark.parametrize(
    "change",
    [
        {"moe_router_num_groups": 0, "moe_router_group_topk": 0},
        {"moe_router_topk_scaling_factor": 1.0},
        {"rope_type": "rope"},
        {"mscale_all_dim": 0.0},
        "expert_bias",
    ],
)
def test_the_fixture_tells_the_routing_and_rope_apart(change, tmp_path):
    """Each DeepSeek feature changes the fixture's logits well beyond the tolerance, so the
    logit comparisons above check its mapping."""
    import_mcore(fixture("deepseek"), tmp_path / "ckpt", config=CONFIG)
    model = our_model(tmp_path / "ckpt")
    if change == "expert_bias":
        with torch.no_grad():
            for layer in (1, 2):
                model.decoder.layers[layer].mlp.router.expert_bias.zero_()
    else:
        other = GPTModel(dataclasses.replace(model.config, **change))
        other.load_state_dict(model.state_dict())
        model = other.eval()
    rec = recorded()
    with torch.no_grad():
        assert relative_error(model(rec["tokens"]), rec["logits"]) > 10 * RELATIVE_TOL


def test_export_hf_of_the_mcore_checkpoint_matches_in_transformers(tmp_path):
    """MCore -> transformers' DeepSeek-V3 (through a hidden import): MCore's logits."""
    from transformers import AutoModelForCausalLM

    from mfsdp_ckpt.mcore import export_hf_from_mcore

    export_hf_from_mcore(fixture("deepseek"), tmp_path / "hf", CONFIG, arch="deepseek_v3")
    rec = recorded()
    theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    with torch.no_grad():
        assert relative_error(theirs(rec["tokens"]).logits, rec["logits"]) <= RELATIVE_TOL


# ---- refusals --------------------------------------------------------------------------------


def _rewrite(tmp_path, edit) -> str:
    """The deepseek fixture's tensors, edited by ``edit(dict) -> dict``, saved in MCore's layout."""
    tensors = {k: v for k, v in stock_read(fixture("deepseek")).items() if isinstance(v, torch.Tensor)}
    return write_mcore(str(tmp_path / "src"), edit(tensors), common={"iteration": 7})


def _cli_refusal(tmp_path, *args: str) -> str:
    (tmp_path / "out").mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "cli.main", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert os.listdir(tmp_path / "out") == []
    return lines[0]


def test_refuses_mla_without_latent_norms(tmp_path):
    """MCore's MLA without ``qk_layernorm`` (its default) has no latent norms; ours always norms
    the latents (as DeepSeek): refused, naming the tensor, through the CLI."""
    src = _rewrite(tmp_path, lambda t: {k: v for k, v in t.items() if "up_proj.layer_norm_weight" not in k})
    line = _cli_refusal(tmp_path, "import-mcore", src, str(tmp_path / "out" / "ckpt"), "--config", CONFIG)
    assert "latent norm" in line and "linear_kv_up_proj.layer_norm_weight" in line and "qk_layernorm" in line


def test_refuses_moe_layers_that_are_not_after_the_dense_ones(tmp_path):
    """MCore's ``moe_layer_freq`` can interleave dense and MoE layers ([1, 0, 1]); our model has
    its dense layers first."""

    def swap(tensors):
        out = {}
        for key, value in tensors.items():
            for a, b in (("decoder.layers.0.", "decoder.layers.1."), ("decoder.layers.1.", "decoder.layers.0.")):
                if key.startswith(a):
                    key = b + key[len(a) :]
                    break
            out[key] = value
        return out

    src = _rewrite(tmp_path, swap)
    with pytest.raises(ConversionError, match=r"MoE layers \[0, 2\] and dense layers \[1\].*dense layers first"):
        import_mcore(src, tmp_path / "ckpt", config=dict(json.load(open(CONFIG)), moe_layer_freq=None))


@pytest.mark.parametrize(
    "args, words",
    [
        ({"mscale": 0.5, "mscale_all_dim": 0.0}, "mscale=0.5 with mscale_all_dim=0.0"),
        ({"rope_type": "rope", "rotary_scaling_factor": 4.0}, "still scales the attention softmax"),
        ({"moe_router_score_function": "softmax"}, "expert bias with moe_router_score_function='softmax'"),
        ({"moe_layer_freq": 1}, "moe_layer_freq=1 disagrees"),
        ({"qk_layernorm": False}, "qk_layernorm=False"),
        ({"mtp_num_layers": 2}, "mtp_num_layers=2 disagrees"),
        ({"qk_head_dim": 16}, "qk_head_dim=16 disagrees"),
        ({"moe_router_load_balancing_type": "sinkhorn"}, "sinkhorn"),
    ],
)
def test_refuses_arguments_our_model_computes_otherwise(args, words, tmp_path):
    with pytest.raises(ConversionError) as e:
        import_mcore(fixture("deepseek"), tmp_path / "ckpt", config=dict(json.load(open(CONFIG)), **args))
    assert words in str(e.value) and "\n" not in str(e.value)
    assert not os.path.exists(tmp_path / "ckpt")


def test_export_refuses_what_it_does_not_map(tmp_path):
    from mfsdp_ckpt.format.manifest import versions
    from mfsdp_ckpt.write.builder import CheckpointBuilder

    cfg = GPTConfig(
        vocab_size=64,
        hidden_size=32,
        num_layers=1,
        num_attention_heads=2,
        num_query_groups=2,
        kv_channels=16,
        ffn_hidden_size=32,
        rope_type="yarn",
        rotary_scaling_factor=2.0,
        original_max_position_embeddings=16,
    )
    with CheckpointBuilder(tmp_path / "ours", {"model_config": cfg.to_dict(), "step": 1, "versions": versions()}) as b:
        for name, p in GPTModel(cfg).named_parameters():
            b.add_tensor(f"model.{name}", p.detach())
        b.commit()
    (tmp_path / "out").mkdir()
    with pytest.raises(ConversionError, match="does not map rope_type='yarn' without multi-latent attention"):
        export_mcore(tmp_path / "ours", tmp_path / "out" / "mcore")
    assert os.listdir(tmp_path / "out") == []


# ---- Megatron-Core loads our exports ---------------------------------------------------------


def _megatron_load(ckpt, names: str, strict: str, logits_out) -> str:
    proc = subprocess.run(
        [
            PYTHON,
            GENERATOR,
            "--check-load",
            str(ckpt),
            "--names",
            names,
            "--strict",
            strict,
            "--logits",
            str(logits_out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "LOADED" in proc.stdout, proc.stdout
    return proc.stdout


@pytest.mark.heavy
@pytest.mark.mcore_env
def test_megatron_loads_the_export_of_the_import_strictly(tmp_path):
    """export-mcore of the imported fixture, loaded by MCore with every key checked both ways
    (``raise_all``), computes bitwise the logits MCore computes from the original fixture on this
    machine, and the recorded ones within the tolerance.

    The bitwise reference is computed here, not read from the recorded file: the recorded logits
    come from the machine that generated the fixture, and another CPU's matmul kernels (AVX-512
    against AVX2, say) round differently (9e-8 here), so a bitwise check against them tests the
    hardware, not the conversion."""
    import_mcore(fixture("deepseek"), tmp_path / "ckpt", world_size=2, config=CONFIG)
    export_mcore(tmp_path / "ckpt", tmp_path / "back", moe_norm="local")
    _megatron_load(tmp_path / "back", "local", "raise_all", tmp_path / "logits.pt")
    original = tmp_path / "original"
    shutil.copytree(fixture("deepseek_local"), original)
    shutil.copy(tmp_path / "back" / "mcore_args.json", original / "mcore_args.json")
    _megatron_load(original, "local", "raise_all", tmp_path / "reference.pt")
    got, ref = (
        torch.load(tmp_path / "logits.pt", weights_only=True),
        torch.load(tmp_path / "reference.pt", weights_only=True),
    )
    rec = recorded()
    assert torch.equal(got["tokens"], rec["tokens"]) and torch.equal(ref["tokens"], rec["tokens"])
    assert torch.equal(got["logits"], ref["logits"]) and torch.equal(got["mtp_logits"], ref["mtp_logits"])
    assert relative_error(got["logits"], rec["logits"]) <= RELATIVE_TOL
    assert relative_error(got["mtp_logits"], rec["mtp_logits"]) <= RELATIVE_TOL


def _stacked_variant(tmp_path) -> str:
    """tiny-deepseek with every layer MoE (MCore stores its layers stacked), no query compression
    (``linear_q_proj``) and YaRN with both mscales: what the fixture does not cover."""
    cfg = dataclasses.replace(
        get_preset("tiny-deepseek"),
        first_k_dense_replace=0,
        q_lora_rank=0,
        rope_type="yarn",
        rotary_scaling_factor=4.0,
        original_max_position_embeddings=8,
        mscale=1.0,
        mscale_all_dim=1.0,
    )
    path = tmp_path / "stacked.json"
    path.write_text(json.dumps(cfg.to_dict()))
    return str(path)


@pytest.mark.heavy  # slow (the inner loop's 8 minutes); CI runs it
@pytest.mark.mcore_env
@pytest.mark.parametrize("variant", ["tiny-deepseek", "stacked"])
def test_our_training_checkpoint_exports_to_what_megatron_loads(variant, tmp_path):
    """A checkpoint trained by ``mfsdp-train`` (two steps, one process) -> export-mcore -> MCore
    builds the model of the exported ``mcore_args.json`` and loads it asking for every key
    (optimizer state is in the export too, so MCore's check is ``raise_unexpected``: nothing it
    asks for is missing); its logits and MTP logits are ours."""
    model = (
        ["--model", "tiny-deepseek"] if variant == "tiny-deepseek" else ["--model-config", _stacked_variant(tmp_path)]
    )
    run = run_train(
        None,
        *model,
        "--steps",
        "2",
        "--batch-size",
        "2",
        "--seq-len",
        "16",
        "--ckpt-dir",
        str(tmp_path),
        "--save-every",
        "2",
    )
    assert run.returncode == 0, failure(run)
    ckpt = tmp_path / "step_000002"
    names = "te" if variant == "tiny-deepseek" else "local"
    export_mcore(ckpt, tmp_path / "mcore", moe_norm=names)
    stored = stock_read(str(tmp_path / "mcore"))
    layer_key = (
        "decoder.layers.1.mlp.router.expert_bias"
        if variant == "tiny-deepseek"
        else "decoder.layers.mlp.router.expert_bias"
    )
    assert layer_key in stored and "mtp.layers.0.eh_proj.weight" in stored
    assert any(k.startswith("optimizer.state.exp_avg.") for k in stored)
    _megatron_load(tmp_path / "mcore", names, "raise_unexpected", tmp_path / "logits.pt")
    got = torch.load(tmp_path / "logits.pt", weights_only=True)
    logits, mtp = logits_and_mtp(our_model(ckpt), got["tokens"])
    assert relative_error(logits, got["logits"]) <= RELATIVE_TOL
    assert relative_error(mtp, got["mtp_logits"]) <= RELATIVE_TOL
