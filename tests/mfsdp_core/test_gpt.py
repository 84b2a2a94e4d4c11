"""The reference GPT models: Megatron-Core parameter names, a forward checked against a plain,
loop-based re-implementation written here, gradients for starved experts, and the config API.

Bitwise (``torch.equal``) wherever the model and the reference run the same floating-point
operations in the same order (norms, fused-QKV slicing, RoPE, MLPs, MoE routing and combination).
The model's attention is ``scaled_dot_product_attention`` (on CPU a fused, blocked online-softmax
kernel). The whole-model reference calls it too, but one head at a time on explicitly sliced
q / k / v, so the whole forward is compared **bitwise**. A separate check compares the model's
attention with an explicit ``softmax(q kᵀ / √d + mask) v``; the two sum in different orders, so
that one agrees to a few ulps (~1e-6 absolute here) and uses ``ATTN_TOL``."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from mfsdp_core.models.gpt import PRESETS, GPTConfig, GPTModel, MoELayer, get_preset

ATTN_TOL = 1e-5  # see the module docstring (sdpa vs explicit softmax summation order)

TINY = PRESETS["tiny"]
TINY_MOE = PRESETS["tiny-moe"]


# --------------------------------------------------------------------------------------------------
# Parameter names


def _layer0_dense() -> list[str]:
    p = "decoder.layers.0."
    return [
        p + "self_attention.linear_qkv.weight",
        p + "self_attention.linear_qkv.layer_norm_weight",
        p + "self_attention.linear_proj.weight",
        p + "mlp.linear_fc1.weight",
        p + "mlp.linear_fc1.layer_norm_weight",
        p + "mlp.linear_fc2.weight",
    ]


def _layer0_moe() -> list[str]:
    p = "decoder.layers.0."
    return [
        p + "self_attention.linear_qkv.weight",
        p + "self_attention.linear_qkv.layer_norm_weight",
        p + "self_attention.linear_proj.weight",
        p + "pre_mlp_layernorm.weight",
        p + "mlp.router.weight",
        p + "mlp.experts.linear_fc1.weight0",
        p + "mlp.experts.linear_fc1.weight1",
        p + "mlp.experts.linear_fc1.weight2",
        p + "mlp.experts.linear_fc1.weight3",
        p + "mlp.experts.linear_fc2.weight0",
        p + "mlp.experts.linear_fc2.weight1",
        p + "mlp.experts.linear_fc2.weight2",
        p + "mlp.experts.linear_fc2.weight3",
        p + "mlp.shared_experts.linear_fc1.weight",
        p + "mlp.shared_experts.linear_fc2.weight",
    ]


@pytest.mark.parametrize(
    "config,layer0", [(TINY, _layer0_dense()), (TINY_MOE, _layer0_moe())], ids=["tiny", "tiny-moe"]
)
def test_parameter_names(config: GPTConfig, layer0: list[str]) -> None:
    names = [n for n, _ in GPTModel(config).named_parameters()]
    layer1 = [n.replace("layers.0.", "layers.1.") for n in layer0]
    expected = [
        "embedding.word_embeddings.weight",
        *layer0,
        *layer1,
        "decoder.final_layernorm.weight",
        "output_layer.weight",
    ]
    assert names == expected
    assert len(names) == 3 + config.num_layers * len(layer0)


def test_tied_embeddings_drop_output_layer_and_qk_norm_names() -> None:
    tied = GPTModel(dataclasses.replace(TINY, tie_embeddings=True, qk_layernorm=True))
    names = [n for n, _ in tied.named_parameters()]
    assert "output_layer.weight" not in names and names[-1] == "decoder.final_layernorm.weight"
    assert "decoder.layers.1.self_attention.q_layernorm.weight" in names
    assert "decoder.layers.1.self_attention.k_layernorm.weight" in names
    assert not any(n.endswith("bias") for n in names)
    assert set(tied.state_dict()) == set(names)  # no buffers in the checkpoint


def test_init_is_deterministic_and_qkv_shape() -> None:
    torch.manual_seed(3)
    a = GPTModel(TINY_MOE)
    torch.manual_seed(3)
    b = GPTModel(TINY_MOE)
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), n
        if p.ndim == 1:
            assert torch.equal(p, torch.ones_like(p)), n
    qkv = a.decoder.layers[0].self_attention.linear_qkv.weight
    c = TINY_MOE
    assert qkv.shape == (
        c.num_query_groups * (c.num_attention_heads // c.num_query_groups + 2) * c.kv_channels,
        c.hidden_size,
    )
    assert isinstance(a.decoder.layers, torch.nn.ModuleList)


# --------------------------------------------------------------------------------------------------
# A plain re-implementation, reading the weights by name


def ref_rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


def ref_rope(x: torch.Tensor, base: float) -> torch.Tensor:
    """``x [t, d]``: rotate each pair (i, i + d/2) at position p by ``p * base^(-2i/d)``."""
    t, d = x.shape
    half = d // 2
    inv_freq = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    angle = torch.arange(t, dtype=torch.float32)[:, None] * inv_freq[None, :]
    cos, sin = angle.cos(), angle.sin()
    x1, x2 = x[:, :half], x[:, half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def ref_qkv(P: dict[str, torch.Tensor], pre: str, c: GPTConfig, x: torch.Tensor) -> tuple[list, list, list]:
    """``x [t, hidden]`` -> per-head q list, per-group k and v lists (each ``[t, d]``), after
    q/k norm and RoPE, by slicing the fused projection group by group."""
    d, heads, groups = c.kv_channels, c.num_attention_heads, c.num_query_groups
    per_group = heads // groups
    y = F.linear(ref_rms(x, P[pre + "linear_qkv.layer_norm_weight"], c.norm_epsilon), P[pre + "linear_qkv.weight"])
    qs, ks, vs = [], [], []
    for g in range(groups):
        base = g * (per_group + 2) * d
        for j in range(per_group):
            qs.append(y[:, base + j * d : base + (j + 1) * d])
        ks.append(y[:, base + per_group * d : base + (per_group + 1) * d])
        vs.append(y[:, base + (per_group + 1) * d : base + (per_group + 2) * d])
    if c.qk_layernorm:
        qs = [ref_rms(q, P[pre + "q_layernorm.weight"], c.norm_epsilon) for q in qs]
        ks = [ref_rms(k, P[pre + "k_layernorm.weight"], c.norm_epsilon) for k in ks]
    return [ref_rope(q, c.rotary_base) for q in qs], [ref_rope(k, c.rotary_base) for k in ks], vs


def ref_attention(P: dict[str, torch.Tensor], pre: str, c: GPTConfig, x: torch.Tensor) -> torch.Tensor:
    """Explicit causal softmax attention, one head at a time; head h uses group h // (heads/groups)."""
    t = x.shape[0]
    qs, ks, vs = ref_qkv(P, pre, c, x)
    per_group = c.num_attention_heads // c.num_query_groups
    mask = torch.triu(torch.full((t, t), float("-inf")), diagonal=1)
    outs = []
    for h, q in enumerate(qs):
        k, v = ks[h // per_group], vs[h // per_group]
        outs.append(torch.softmax(q @ k.T / math.sqrt(c.kv_channels) + mask, dim=-1) @ v)
    return F.linear(torch.cat(outs, dim=-1), P[pre + "linear_proj.weight"])


def ref_attention_sdpa(P: dict[str, torch.Tensor], pre: str, c: GPTConfig, x: torch.Tensor) -> torch.Tensor:
    """The same, with ``scaled_dot_product_attention`` called per head (the model batches heads)."""
    qs, ks, vs = ref_qkv(P, pre, c, x)
    per_group = c.num_attention_heads // c.num_query_groups
    outs = []
    for h, q in enumerate(qs):
        k, v = ks[h // per_group], vs[h // per_group]
        outs.append(F.scaled_dot_product_attention(q[None, None], k[None, None], v[None, None], is_causal=True)[0, 0])
    return F.linear(torch.cat(outs, dim=-1), P[pre + "linear_proj.weight"])


def ref_swiglu(x: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor) -> torch.Tensor:
    ffn = fc1.shape[0] // 2
    h = F.linear(x, fc1)
    return F.linear(F.silu(h[:, :ffn]) * h[:, ffn:], fc2)


def ref_moe(P: dict[str, torch.Tensor], pre: str, c: GPTConfig, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [n, hidden]`` (already normed) -> (output, aux loss), looping over experts and tokens."""
    n, E, k = x.shape[0], c.num_experts, c.moe_router_topk
    logits = F.linear(x.float(), P[pre + "router.weight"].float())
    if c.moe_score_func == "softmax":
        dist = torch.softmax(logits, dim=-1)
        top_w, top_idx = torch.topk(dist, k, dim=-1)
        top_w = top_w / top_w.sum(-1, keepdim=True)
    else:
        scores = torch.sigmoid(logits)
        top_w, top_idx = torch.topk(scores, k, dim=-1)
        if k > 1:
            top_w = top_w / top_w.sum(-1, keepdim=True)
        dist = scores / scores.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    aux = torch.zeros(())
    for e in range(E):
        tokens = [i for i in range(n) if e in top_idx[i].tolist()]
        y = ref_swiglu(x[tokens], P[pre + f"experts.linear_fc1.weight{e}"], P[pre + f"experts.linear_fc2.weight{e}"])
        for row, i in enumerate(tokens):
            slot = top_idx[i].tolist().index(e)
            out[i] = out[i] + y[row] * top_w[i, slot]
        aux = aux + (len(tokens) / (n * k)) * dist[:, e].mean()
    if c.moe_shared_expert_ffn_hidden_size:
        out = out + ref_swiglu(
            x, P[pre + "shared_experts.linear_fc1.weight"], P[pre + "shared_experts.linear_fc2.weight"]
        )
    return out, c.moe_aux_loss_coeff * E * aux


def ref_forward(model: GPTModel, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits ``[b, t, vocab]`` and total aux loss, one sequence at a time."""
    c = model.config
    P = {n: p.detach() for n, p in model.named_parameters()}
    eps = c.norm_epsilon
    all_logits, aux = [], torch.zeros(())
    for seq in tokens:
        x = P["embedding.word_embeddings.weight"][seq]
        for i in range(c.num_layers):
            pre = f"decoder.layers.{i}."
            x = x + ref_attention_sdpa(P, pre + "self_attention.", c, x)
            if c.num_experts:
                y, a = ref_moe(P, pre + "mlp.", c, ref_rms(x, P[pre + "pre_mlp_layernorm.weight"], eps))
                x, aux = x + y, aux + a
            else:
                h = ref_rms(x, P[pre + "mlp.linear_fc1.layer_norm_weight"], eps)
                x = x + ref_swiglu(h, P[pre + "mlp.linear_fc1.weight"], P[pre + "mlp.linear_fc2.weight"])
        x = ref_rms(x, P["decoder.final_layernorm.weight"], eps)
        head = P["embedding.word_embeddings.weight"] if c.tie_embeddings else P["output_layer.weight"]
        all_logits.append(F.linear(x, head))
    return torch.stack(all_logits), aux


# --------------------------------------------------------------------------------------------------
# Forward against the reference


def randomised(config: GPTConfig, seed: int = 0) -> GPTModel:
    """A model whose weights are large enough to make attention, routing and norms non-trivial
    (the N(0, 0.02²) init gives near-uniform attention): 2-D weights ~ N(0, 1/fan_in), norm
    weights ~ 1 + N(0, 0.2²), embeddings ~ N(0, 1)."""
    torch.manual_seed(seed)
    model = GPTModel(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif "word_embeddings" in name:
                p.normal_()
            else:
                p.normal_(0.0, p.shape[1] ** -0.5)
    return model


CASES = {
    "mha": dict(num_query_groups=4),
    "gqa2": dict(),
    "gqa4-headdim24-qknorm": dict(num_query_groups=1, kv_channels=24, qk_layernorm=True),
    "gqa2-qknorm-tied": dict(qk_layernorm=True, tie_embeddings=True),
    "moe-top1-softmax": dict(num_experts=4, moe_router_topk=1, moe_ffn_hidden_size=64),
    "moe-top2-softmax-shared": dict(
        num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64, moe_shared_expert_ffn_hidden_size=32
    ),
    "moe-top2-sigmoid": dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64, moe_score_func="sigmoid"),
    "moe-top1-sigmoid-shared-mha": dict(
        num_experts=4,
        moe_router_topk=1,
        moe_ffn_hidden_size=64,
        moe_score_func="sigmoid",
        moe_shared_expert_ffn_hidden_size=64,
        num_query_groups=4,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_components_match_reference(case: str) -> None:
    """Layer 0 piece by piece on the same input: QKV slicing + q/k norm + RoPE, the MLP or MoE
    (output and aux loss) bitwise; attention within ATTN_TOL."""
    c = dataclasses.replace(TINY, **CASES[case])
    model = randomised(c)
    layer = model.decoder.layers[0]
    P = {n: p.detach() for n, p in model.named_parameters()}
    torch.manual_seed(1)
    x = torch.randn(2, 12, c.hidden_size)
    with torch.no_grad():
        q, k, v = layer.self_attention.project_qkv(x)
        attn = layer.self_attention(x)
        if c.num_experts:
            mlp = layer.mlp(layer.pre_mlp_layernorm(x))
            aux = layer.mlp.aux_loss
        else:
            mlp = layer.mlp(x)
    for b in range(2):
        qs, ks, vs = ref_qkv(P, "decoder.layers.0.self_attention.", c, x[b])
        assert torch.equal(q[b], torch.stack(qs))
        assert torch.equal(k[b], torch.stack(ks)) and torch.equal(v[b], torch.stack(vs))
        torch.testing.assert_close(
            attn[b], ref_attention(P, "decoder.layers.0.self_attention.", c, x[b]), atol=ATTN_TOL, rtol=0
        )
        if not c.num_experts:
            h = ref_rms(x[b], P["decoder.layers.0.mlp.linear_fc1.layer_norm_weight"], c.norm_epsilon)
            assert torch.equal(
                mlp[b],
                ref_swiglu(h, P["decoder.layers.0.mlp.linear_fc1.weight"], P["decoder.layers.0.mlp.linear_fc2.weight"]),
            )
    if c.num_experts:  # routing is over all b*t tokens at once
        flat = x.reshape(-1, c.hidden_size)
        ref_out, ref_aux = ref_moe(
            P, "decoder.layers.0.mlp.", c, ref_rms(flat, P["decoder.layers.0.pre_mlp_layernorm.weight"], c.norm_epsilon)
        )
        assert torch.equal(mlp.reshape(-1, c.hidden_size), ref_out)
        # the aux loss sums the same terms in a different order (vectorised vs a loop over experts)
        torch.testing.assert_close(aux, ref_aux, atol=1e-7, rtol=1e-6)
        assert int(layer.mlp.tokens_per_expert.sum()) == flat.shape[0] * c.moe_router_topk


@pytest.mark.parametrize("case", list(CASES))
def test_forward_matches_reference(case: str) -> None:
    """Whole model: fp32 logits bitwise equal to the reference. Batch rows are routed jointly in
    the model but per sequence in the reference, so MoE cases use batch 1."""
    c = dataclasses.replace(TINY, **CASES[case])
    model = randomised(c)
    torch.manual_seed(2)
    tokens = torch.randint(0, c.vocab_size, (1 if c.num_experts else 2, 12))
    with torch.no_grad():
        logits = model(tokens)
    ref_logits, ref_aux = ref_forward(model, tokens)
    assert logits.dtype == torch.float32 and logits.shape == (*tokens.shape, c.vocab_size)
    assert torch.equal(logits, ref_logits), float((logits - ref_logits).abs().max())
    torch.testing.assert_close(model.aux_loss, ref_aux, atol=1e-6, rtol=1e-5)
    if not c.num_experts:
        assert float(model.aux_loss) == 0.0


# --------------------------------------------------------------------------------------------------
# Every parameter gets a gradient, even experts that receive no tokens


@pytest.mark.parametrize("topk", [1, 2])
def test_starved_experts_still_get_gradients(topk: int) -> None:
    """Force the routing: embedding dim 0 dominates the residual stream, so after RMSNorm every
    token looks alike to a router that only reads dim 0 and prefers expert 0, then expert 1."""
    torch.manual_seed(0)
    model = GPTModel(dataclasses.replace(TINY_MOE, moe_router_topk=topk))
    with torch.no_grad():
        model.embedding.word_embeddings.weight[:, 0] = 50.0
        for layer in model.decoder.layers:
            layer.mlp.router.weight.zero_()
            layer.mlp.router.weight[0, 0] = 1.0
            layer.mlp.router.weight[1, 0] = 0.5
    tokens = torch.randint(0, TINY_MOE.vocab_size, (2, 10))
    logits = model(tokens)
    (logits.pow(2).mean() + model.aux_loss).backward()

    starved = range(topk, TINY_MOE.num_experts)
    for layer in model.decoder.layers:
        assert isinstance(layer.mlp, MoELayer)
        assert layer.mlp.tokens_per_expert.tolist() == [20] * topk + [0] * len(starved)
    for name, p in model.named_parameters():
        assert p.grad is not None, name
    for i in range(TINY_MOE.num_layers):
        for e in starved:
            for fc in ("linear_fc1", "linear_fc2"):
                grad = dict(model.named_parameters())[f"decoder.layers.{i}.mlp.experts.{fc}.weight{e}"].grad
                assert torch.count_nonzero(grad) == 0
        assert torch.count_nonzero(model.decoder.layers[i].mlp.experts.linear_fc1.weight0.grad) > 0


# --------------------------------------------------------------------------------------------------
# Presets and config


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_build_and_shard_in_32_row_blocks(name: str) -> None:
    c = get_preset(name)
    torch.manual_seed(0)
    model = GPTModel(c)
    for n, p in model.named_parameters():
        if p.ndim == 2 and not n.endswith("router.weight"):
            assert p.shape[0] % 32 == 0, (n, tuple(p.shape))
    logits = model(torch.randint(0, c.vocab_size, (1, 8)))
    assert logits.shape == (1, 8, c.vocab_size) and torch.isfinite(logits).all()
    assert GPTConfig.from_dict(c.to_dict()) == c
    assert ("output_layer.weight" in dict(model.named_parameters())) != c.tie_embeddings


def test_unknown_preset() -> None:
    with pytest.raises(ValueError, match=r"unknown model preset 'nope'; expected one of .*tiny"):
        get_preset("nope")


def test_config_dict_roundtrip_and_unknown_key() -> None:
    import json

    c = get_preset("qwen3-like-small")
    d = json.loads(json.dumps(c.to_dict()))
    assert GPTConfig.from_dict(d) == c
    with pytest.raises(ValueError, match="moe_bogus"):
        GPTConfig.from_dict({**d, "moe_bogus": 1})


def test_config_rejects_bad_shapes_and_long_sequences() -> None:
    with pytest.raises(ValueError, match="num_query_groups"):
        dataclasses.replace(TINY, num_query_groups=3)
    with pytest.raises(ValueError, match="moe_router_topk"):
        dataclasses.replace(TINY_MOE, moe_router_topk=5)
    with pytest.raises(ValueError, match="seq_length"):
        GPTModel(TINY)(torch.zeros(1, TINY.seq_length + 1, dtype=torch.long))
