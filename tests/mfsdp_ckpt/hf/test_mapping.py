"""The mapping language and registry on their own: split/merge are inverse and agree with our
model's layouts, every architecture covers its model exactly, a new architecture is one module
(here registered from a test, with a shared expert), and the model options the bridge added
(q/k/v bias, un-renormalised top-k) keep old configs loading as before."""

from __future__ import annotations

import pytest
import torch

from mfsdp_ckpt.errors import ConversionError
from mfsdp_ckpt.hf import (
    Architecture,
    Direct,
    FusedQKV,
    GatedMLP,
    architectures,
    get_architecture,
    register,
)
from mfsdp_ckpt.hf.archs._common import H, L
from mfsdp_ckpt.hf.files import parse_size
from mfsdp_ckpt.hf.mapping import (
    canonical_shapes,
    check_against,
    expand,
    shared_expert,
    untied,
)
from mfsdp_ckpt.hf.registry import infer_architecture
from mfsdp_core.models.gpt import PRESETS, GPTConfig, GPTModel, MoELayer


def _config(**kw) -> GPTConfig:
    base = dict(
        vocab_size=64,
        hidden_size=32,
        num_layers=2,
        num_attention_heads=8,
        num_query_groups=2,
        kv_channels=8,
        ffn_hidden_size=48,
    )
    return GPTConfig(**{**base, **kw})


def test_registry_discovers_the_five_architectures():
    assert {"llama", "qwen2", "qwen3", "mixtral", "qwen3_moe"} <= set(architectures())
    with pytest.raises(ConversionError, match="unknown architecture 'gpt2'; known: .*llama"):
        get_architecture("gpt2")


@pytest.mark.parametrize("groups", [1, 2, 4, 8])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_qkv_split_is_our_models_per_group_layout(groups, bias):
    """Split the fused weight as the bridge does and compare q/k/v with what our attention
    computes from the fused projection (``project_qkv`` before RoPE: use position 0)."""
    c = _config(num_query_groups=groups, add_qkv_bias=bias)
    torch.manual_seed(0)
    model = GPTModel(c)
    attn = model.decoder.layers[0].self_attention
    with torch.no_grad():
        if bias:
            attn.linear_qkv.bias.normal_()
        x = torch.randn(1, 1, c.hidden_size)
        q, k, v = attn.project_qkv(x)  # [1, heads|groups, 1, d]; RoPE at position 0 is the identity
        rule = FusedQKV("w", ("q", "k", "v"))
        wq, wk, wv = rule.split(attn.linear_qkv.weight, c)
        bq, bk, bv = rule.split(attn.linear_qkv.bias, c) if bias else (0, 0, 0)
        from mfsdp_core.models.gpt import rms_norm

        h = rms_norm(x, attn.linear_qkv.layer_norm_weight, c.norm_epsilon)[0, 0]
        torch.testing.assert_close(wq @ h + bq, q.reshape(-1), rtol=0, atol=1e-6)
        torch.testing.assert_close(wk @ h + bk, k.reshape(-1), rtol=0, atol=1e-6)
        torch.testing.assert_close(wv @ h + bv, v.reshape(-1), rtol=0, atol=1e-6)
        assert torch.equal(rule.merge([wq, wk, wv], c), attn.linear_qkv.weight)
        assert [tuple(s) for s in rule.their_shapes(attn.linear_qkv.weight.shape, c)] == [
            tuple(wq.shape),
            tuple(wk.shape),
            tuple(wv.shape),
        ]


def test_gated_mlp_is_gate_then_up():
    c = _config()
    t = torch.arange(2 * 48 * 32, dtype=torch.float32).reshape(96, 32)
    gate, up = GatedMLP("w", ("g", "u")).split(t, c)
    assert torch.equal(gate, t[:48]) and torch.equal(up, t[48:])
    assert torch.equal(GatedMLP("w", ("g", "u")).merge([gate, up], c), t)


@pytest.mark.parametrize(
    "name,config",
    [
        ("llama", _config()),
        ("llama", _config(tie_embeddings=True)),
        ("qwen2", _config(add_qkv_bias=True)),
        ("qwen3", _config(qk_layernorm=True)),
        ("mixtral", _config(num_experts=4, moe_ffn_hidden_size=16, moe_router_topk=1)),
        ("qwen3_moe", _config(num_experts=4, moe_ffn_hidden_size=16, qk_layernorm=True, moe_router_pre_softmax=True)),
    ],
)
def test_each_architecture_covers_its_model_exactly_and_is_inferred(name, config):
    arch = get_architecture(name)
    assert arch.unsupported(config) == []
    conversions = expand(arch, config)
    assert {c.ours for c in conversions} == set(check_against(conversions, config, arch))
    assert infer_architecture(config, None, "x") is arch
    assert arch.from_hf_config(arch.to_hf_config(config), "x") == config or name in ("mixtral",)


def test_mixtral_round_trip_of_the_config_keeps_what_mixtral_stores():
    """Mixtral has one intermediate size: our unused dense ``ffn_hidden_size`` becomes the expert
    size (documented in docs/hf.md)."""
    c = _config(num_experts=4, moe_ffn_hidden_size=16)
    back = get_architecture("mixtral").from_hf_config(get_architecture("mixtral").to_hf_config(c), "x")
    assert back == GPTConfig(**{**c.to_dict(), "ffn_hidden_size": 16})


def test_what_no_architecture_can_express_is_named():
    with pytest.raises(ConversionError, match="no known architecture can express this model config.*shared expert"):
        infer_architecture(PRESETS["tiny-moe"], None, "ckpt")
    assert "a shared expert (moe_shared_expert_ffn_hidden_size=64)" in get_architecture("mixtral").unsupported(
        PRESETS["tiny-moe"]
    )
    assert any("q/k norms" in p for p in get_architecture("llama").unsupported(PRESETS["qwen3-like-small"]))


def test_a_new_architecture_is_one_declaration_with_shared_experts():
    """What an architecture module holds (here: DeepSeek-style names for an MoE with an ungated
    shared expert, which none of the five built-in architectures has)."""
    rules = (
        Direct("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
        Direct(L + "self_attention.linear_qkv.layer_norm_weight", H + "input_layernorm.weight"),
        FusedQKV(L + "self_attention.linear_qkv.weight", (H + "q.weight", H + "k.weight", H + "v.weight")),
        Direct(L + "self_attention.linear_proj.weight", H + "o.weight"),
        Direct(L + "pre_mlp_layernorm.weight", H + "post_attention_layernorm.weight"),
        Direct(L + "mlp.router.weight", H + "mlp.gate.weight"),
        GatedMLP(
            L + "mlp.experts.linear_fc1.weight{e}",
            (H + "mlp.experts.{e}.gate_proj.weight", H + "mlp.experts.{e}.up_proj.weight"),
        ),
        Direct(L + "mlp.experts.linear_fc2.weight{e}", H + "mlp.experts.{e}.down_proj.weight"),
        GatedMLP(
            L + "mlp.shared_experts.linear_fc1.weight",
            (H + "mlp.shared_experts.gate_proj.weight", H + "mlp.shared_experts.up_proj.weight"),
            when=shared_expert,
        ),
        Direct(
            L + "mlp.shared_experts.linear_fc2.weight", H + "mlp.shared_experts.down_proj.weight", when=shared_expert
        ),
        Direct("decoder.final_layernorm.weight", "model.norm.weight"),
        Direct("output_layer.weight", "lm_head.weight", when=untied),
    )
    arch = Architecture(
        "test_shared", "test_shared", "TestForCausalLM", rules, lambda c: [], lambda c: {}, lambda d, s: None
    )
    c = PRESETS["tiny-moe"]
    conversions = expand(arch, c)
    check_against(conversions, c, arch)
    theirs = [k for conv in conversions for k in conv.theirs]
    assert (
        "model.layers.1.mlp.experts.3.down_proj.weight" in theirs
        and "model.layers.0.mlp.shared_experts.up_proj.weight" in theirs
    )
    assert len(theirs) == len(set(theirs))
    register(arch)
    try:
        assert get_architecture("test_shared") is arch
    finally:
        architectures().pop("test_shared")


def test_a_rule_that_writes_a_key_twice_is_refused():
    rules = (Direct("embedding.word_embeddings.weight", "x"), Direct("decoder.final_layernorm.weight", "x"))
    arch = Architecture("broken", "broken", "B", rules, lambda c: [], lambda c: {}, lambda d, s: None)
    with pytest.raises(ConversionError, match="more than once: x"):
        expand(arch, _config())
    partial = Architecture("partial", "partial", "P", rules[:1], lambda c: [], lambda c: {}, lambda d, s: None)
    with pytest.raises(
        ConversionError, match="no rule for model.decoder.final_layernorm.weight, model.decoder.layers.0"
    ):
        check_against(expand(partial, _config()), _config(), partial)


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30 and parse_size("100") == 100
    assert parse_size("1.5MB") == 1_500_000
    with pytest.raises(ConversionError, match="max shard size 'five'"):
        parse_size("five")


def test_new_model_options_default_off_and_old_configs_load():
    old = PRESETS["tiny"].to_dict()
    del old["add_qkv_bias"], old["moe_router_pre_softmax"]
    assert GPTConfig.from_dict(old) == PRESETS["tiny"]
    names = [n for n, _ in GPTModel(PRESETS["tiny"]).named_parameters()]
    assert not any(n.endswith(".bias") for n in names)
    torch.manual_seed(0)
    biased = GPTModel(_config(add_qkv_bias=True))
    assert torch.equal(biased.decoder.layers[0].self_attention.linear_qkv.bias, torch.zeros(12 * 8))
    assert canonical_shapes(_config(add_qkv_bias=True))["model.decoder.layers.1.self_attention.linear_qkv.bias"] == (
        96,
    )
    with pytest.raises(ValueError, match="softmax routing only"):
        _config(num_experts=4, moe_ffn_hidden_size=16, moe_score_func="sigmoid", moe_router_pre_softmax=True)


def test_pre_softmax_keeps_the_top_k_probabilities():
    c = _config(num_experts=4, moe_ffn_hidden_size=16, moe_router_topk=2)
    torch.manual_seed(0)
    layer = MoELayer(c)
    with torch.no_grad():
        layer.router.weight.normal_()
    x = torch.randn(5, c.hidden_size)
    renorm_w, idx, dist = layer.route(x)
    layer.pre_softmax = True
    raw_w, idx2, _ = layer.route(x)
    assert torch.equal(idx, idx2)
    assert torch.equal(raw_w, torch.gather(dist, 1, idx))
    torch.testing.assert_close(renorm_w, raw_w / raw_w.sum(-1, keepdim=True), rtol=0, atol=0)
