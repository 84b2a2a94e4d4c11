"""Tiny genuine ``transformers`` causal LMs written as Hugging Face model directories (what
``save_pretrained`` writes: ``config.json``, ``generation_config.json``, safetensors, and a
small word-level tokenizer), for the tests of ``--hf-model`` and of exports of their checkpoints."""

from __future__ import annotations

import os
from typing import Any

import torch

VOCAB = 96
#: one small config per family: dense (Llama; Qwen2 with q/k/v biases; Qwen3 tied, with qk-norm)
#: and MoE with fused experts (Mixtral; Qwen3-MoE with one dense layer)
CONFIGS: dict[str, dict[str, Any]] = {
    "llama": dict(
        model_type="llama",
        hidden_size=32,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    ),
    "qwen2": dict(
        model_type="qwen2",
        hidden_size=32,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    ),
    "qwen3": dict(
        model_type="qwen3",
        hidden_size=32,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        tie_word_embeddings=True,
    ),
    "mixtral": dict(
        model_type="mixtral",
        hidden_size=32,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
    ),
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        hidden_size=32,
        intermediate_size=40,
        moe_intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[1],
        tie_word_embeddings=False,
    ),
}


def hf_config(family: str, **changes: Any) -> Any:
    """transformers' config object of ``family`` (``changes`` applied)."""
    from transformers import AutoConfig

    d = {**CONFIGS[family], "vocab_size": VOCAB, "max_position_embeddings": 64, **changes}
    return AutoConfig.for_model(d.pop("model_type"), **d)


def make_hf_dir(path: str | os.PathLike, family: str, *, weights: bool = True, seed: int = 1, **changes: Any) -> str:
    """Write a model directory of ``family`` at ``path``: the model (seeded by ``seed``) saved by
    ``save_pretrained`` (``weights=False``: only its config and generation config), and a
    word-level tokenizer saved by ``PreTrainedTokenizerFast.save_pretrained``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (
        AutoModelForCausalLM,
        GenerationConfig,
        PreTrainedTokenizerFast,
    )

    path = os.fspath(path)
    config = hf_config(family, **changes)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    if weights:
        model.save_pretrained(path)
    else:
        os.makedirs(path, exist_ok=True)
        config.architectures = [type(model).__name__]
        config.save_pretrained(path)
        GenerationConfig.from_model_config(config).save_pretrained(path)
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="w0", eos_token="w1").save_pretrained(path)
    return path
