"""Translating between our model config (``GPTConfig``) and a Hugging Face ``config.json`` dict,
for the fields every supported architecture shares (Llama-family decoders: RMSNorm, RoPE, GQA,
SwiGLU). Architecture modules add their own fields on top.

``config.json`` is read as plain JSON: the bridge does not need ``transformers`` installed.
Written configs carry both spellings of the RoPE base (``rope_theta``, read by transformers 4.x,
and ``rope_parameters``, read by 5.x) so either version loads them.
"""

from __future__ import annotations

from typing import Any

from mfsdp_core.models.gpt import GPTConfig

from ..errors import ConversionError

__all__ = ["HFConfigReader", "common_to_hf", "common_from_hf", "model_config"]

_MISSING = object()


class HFConfigReader:
    """Reads fields of a ``config.json`` dict and collects everything our model cannot express,
    so one error names all of it."""

    def __init__(self, d: dict[str, Any], source: str, arch: str) -> None:
        self.d, self.source, self.arch = d, source, arch
        self.problems: list[str] = []

    def get(self, key: str, default: Any = _MISSING) -> Any:
        if key in self.d and self.d[key] is not None:
            return self.d[key]
        if default is _MISSING:
            raise ConversionError(f"{self.source}: config.json has no '{key}' (needed for {self.arch})")
        return default

    def refuse(self, ok: bool, what: str) -> None:
        """Note ``what`` (a phrase naming the field and its value) unless ``ok``."""
        if not ok:
            self.problems.append(what)

    def finish(self) -> None:
        if self.problems:
            raise ConversionError(f"{self.source}: {self.arch} config cannot be expressed by our model: {'; '.join(self.problems)}")


def common_to_hf(c: GPTConfig, model_type: str, hf_class: str) -> dict[str, Any]:
    """The ``config.json`` fields shared by the Llama family."""
    return {
        "architectures": [hf_class],
        "model_type": model_type,
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_query_groups,
        "head_dim": c.kv_channels,
        "hidden_act": "silu",
        "max_position_embeddings": c.seq_length,
        "rms_norm_eps": c.norm_epsilon,
        "rope_theta": c.rotary_base,
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rotary_base},
        "rope_scaling": None,
        "tie_word_embeddings": c.tie_embeddings,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
    }


def common_from_hf(r: HFConfigReader, *, tie_default: bool) -> dict[str, Any]:
    """``GPTConfig`` keyword arguments from the shared fields; notes what we cannot express."""
    heads = int(r.get("num_attention_heads"))
    hidden = int(r.get("hidden_size"))
    rope = r.get("rope_parameters", None) or {}
    scaling = r.get("rope_scaling", None)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    r.refuse(rope_type == "default", f"rope_parameters.rope_type={rope_type!r} (only plain RoPE)")
    if isinstance(scaling, dict):
        kind = scaling.get("rope_type", scaling.get("type"))
        r.refuse(kind in (None, "default"), f"rope_scaling={scaling!r} (only plain RoPE)")
    act = r.get("hidden_act", "silu")
    r.refuse(act in ("silu", "swish"), f"hidden_act={act!r} (only SwiGLU with silu)")
    return {
        "vocab_size": int(r.get("vocab_size")),
        "hidden_size": hidden,
        "num_layers": int(r.get("num_hidden_layers")),
        "num_attention_heads": heads,
        "num_query_groups": int(r.get("num_key_value_heads", heads)),
        "kv_channels": int(r.get("head_dim", hidden // heads)),
        "rotary_base": float(rope.get("rope_theta", r.get("rope_theta", 10000.0))),
        "norm_epsilon": float(r.get("rms_norm_eps", 1e-6)),
        "seq_length": int(r.get("max_position_embeddings", 2048)),
        "tie_embeddings": bool(r.get("tie_word_embeddings", tie_default)),
    }


def model_config(r: HFConfigReader, kwargs: dict[str, Any]) -> GPTConfig:
    """Raise for everything noted so far, then build the config (its own checks become a
    :class:`ConversionError` too)."""
    r.finish()
    try:
        return GPTConfig(**kwargs)
    except ValueError as e:
        raise ConversionError(f"{r.source}: {r.arch} config is not a valid model config: {e}") from None
