"""Tiny random Hugging Face models built from ``transformers`` configs (no network), and our
reference model loaded from a canonical checkpoint, for the bridge tests."""

from __future__ import annotations

import os

import torch

from mfsdp_ckpt.read.reader import CheckpointReader
from mfsdp_core.models.gpt import GPTConfig, GPTModel

VOCAB = 96


def hf_config(arch: str, **overrides):
    """A tiny ``transformers`` config of ``arch``; ``overrides`` are its own field names."""
    import transformers as tf

    base = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    if arch == "llama":
        return tf.LlamaConfig(
            **{**base, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}, **overrides}
        )
    if arch == "qwen2":
        return tf.Qwen2Config(**{**base, **overrides})
    if arch == "qwen3":
        return tf.Qwen3Config(**{**base, "head_dim": 8, **overrides})
    if arch == "mixtral":
        return tf.MixtralConfig(**{**base, "num_local_experts": 4, "num_experts_per_tok": 2, **overrides})
    if arch == "qwen3_moe":
        return tf.Qwen3MoeConfig(
            **{
                **base,
                "head_dim": 8,
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 24,
                "norm_topk_prob": True,
                **overrides,
            }
        )
    raise ValueError(arch)


def random_hf_model(config, seed: int = 0, dtype: torch.dtype = torch.float32):
    """The ``AutoModelForCausalLM`` of ``config`` with every parameter random (norm weights around
    1, biases and routers too), so that no mapping mistake can hide behind a constant."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))
    return model.to(dtype).eval()


def save_hf(model, path: str, max_shard_size: str | None = None) -> str:
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    return path


def hf_tensors(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of an HF directory (all its safetensors files)."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            for k, v in load_file(os.path.join(path, name)).items():
                assert k not in out, k
                out[k] = v
    return out


def reference_model(checkpoint: str) -> GPTModel:
    """Our GPTModel with the ``model.*`` weights of a canonical checkpoint (fp32, eval)."""
    with CheckpointReader(checkpoint) as reader:
        config = GPTConfig.from_dict(reader.manifest["model_config"])
        model = GPTModel(config)
        state = {k[len("model.") :]: reader.read(k) for k in reader.keys() if k.startswith("model.")}
    model.load_state_dict(state, strict=True)
    return model.float().eval()


def tokens(batch: int = 2, seq: int = 24, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, seq), generator=g)
