"""Translating between the model shape (``ModelShape``) and a Hugging Face ``config.json`` dict,
for the fields every supported architecture shares (Llama-family decoders: RMSNorm, RoPE, GQA,
SwiGLU). Architecture modules add their own fields on top.

``config.json`` is read as plain JSON: the bridge does not need ``transformers`` installed.
Written configs carry both spellings of the RoPE base (``rope_theta``, read by transformers 4.x,
and ``rope_parameters``, read by 5.x) so either version loads them.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from mfsdp_ckpt.errors import ConversionError
from mfsdp_ckpt.hf.files import short_repr
from mfsdp_ckpt.model.shape import ModelShape

__all__ = [
    "HFConfigReader",
    "common_to_hf",
    "common_from_hf",
    "read_rope",
    "model_config",
    "model_type_of",
    "hf_classes_of",
    "MAX_COUNT",
    "MAX_WIDTH",
    "MAX_POSITIONS",
]

_MISSING = object()

#: the most layers, attention heads, key/value heads or experts a config may declare
MAX_COUNT = 2**16
#: the widest dimension a config may declare (vocabulary, hidden, FFN, head dimension, all heads
#: together): far above any real model, and low enough that no product of two widths overflows
#: the 64-bit sizes torch computes, even on the meta device
MAX_WIDTH = 2**24
#: the longest context a config may declare
MAX_POSITIONS = 2**31 - 1

Keys = str | Sequence[str]


class HFConfigReader:
    """Reads fields of a ``config.json`` dict and collects everything our model cannot express,
    so one error names all of it.

    ``config.json`` comes from anywhere: the typed getters (:meth:`integer`, :meth:`number`,
    :meth:`flag`, :meth:`text`, :meth:`section`, :meth:`integers`) accept only the JSON type the
    field has in a real config, within bounds, and otherwise raise one
    :class:`ConversionError` line naming the file and the field, before any value reaches our
    model config (a string, a float, a bool, NaN or 10⁴⁰⁰ where a count goes would otherwise be
    converted silently or surface as a traceback far away). A value that is well-formed but that
    our model cannot express goes to :meth:`refuse` and is reported with the others by
    :meth:`finish`. A missing field without a default is an error naming it; ``null`` counts as
    missing (transformers writes ``null`` for unset optional fields)."""

    def __init__(self, d: dict[str, Any], source: str, arch: str, *, prefix: str = "") -> None:
        if not isinstance(d, dict):
            raise ConversionError(
                f"{source}: config.json{' ' + repr(prefix[:-1]) if prefix else ''} is not a JSON object "
                f"(got {short_repr(d)})"
            )
        self.d, self.source, self.arch, self.prefix = d, source, arch, prefix
        self.problems: list[str] = []

    def get(self, key: str, default: Any = _MISSING) -> Any:
        """The raw value of ``key`` (unchecked; for architectures that read a field of their own
        and check it themselves)."""
        if key in self.d and self.d[key] is not None:
            return self.d[key]
        if default is _MISSING:
            raise ConversionError(f"{self.source}: config.json has no '{self.prefix}{key}' (needed for {self.arch})")
        return default

    def _lookup(self, keys: Keys, default: Any) -> tuple[str, Any, bool]:
        """The first of ``keys`` present (not null): its name, value and True; else the first
        name, ``default`` and False (raising when there is no default)."""
        names = (keys,) if isinstance(keys, str) else tuple(keys)
        for key in names:
            if key in self.d and self.d[key] is not None:
                return key, self.d[key], True
        if default is _MISSING:
            raise ConversionError(
                f"{self.source}: config.json has no '{self.prefix}{names[0]}' (needed for {self.arch})"
            )
        return names[0], default, False

    def bad(self, key: str, expected: str, value: Any) -> ConversionError:
        """The error for field ``key`` holding ``value`` where ``expected`` belongs."""
        return ConversionError(
            f"{self.source}: config.json: '{self.prefix}{key}' must be {expected}, got {short_repr(value)}"
        )

    def integer(self, keys: Keys, default: Any = _MISSING, *, lo: int = 1, hi: int = MAX_WIDTH) -> Any:
        """A JSON integer (not a bool, a float or a string) in ``[lo, hi]``; ``default``
        (returned as is) when absent."""
        key, value, present = self._lookup(keys, default)
        if present and (type(value) is not int or not lo <= value <= hi):
            raise self.bad(key, f"an integer in [{lo}, {hi}]", value)
        return value

    def number(
        self,
        keys: Keys,
        default: Any = _MISSING,
        *,
        lo: float = -math.inf,
        hi: float = math.inf,
        above: bool = False,
        below: bool = False,
    ) -> Any:
        """A finite JSON number (integer or float, not a bool or a string) in ``[lo, hi]``
        (``above`` / ``below``: excluding ``lo`` / ``hi``), as a float; ``default`` when absent."""
        key, value, present = self._lookup(keys, default)
        if not present:
            return value
        what = (
            f"a finite number {'>' if above else '>='} {lo:g}"
            if hi == math.inf
            else f"a finite number in {'(' if above else '['}{lo:g}, {hi:g}{')' if below else ']'}"
        )
        if type(value) not in (int, float):
            raise self.bad(key, what, value)
        try:
            x = float(value)
        except OverflowError:
            raise self.bad(key, what, value) from None
        if not math.isfinite(x) or x < lo or x > hi or (above and x == lo) or (below and x == hi):
            raise self.bad(key, what, value)
        return x

    def flag(self, keys: Keys, default: Any = _MISSING) -> Any:
        """A JSON boolean (``"false"`` is a string, not false)."""
        key, value, present = self._lookup(keys, default)
        if present and type(value) is not bool:
            raise self.bad(key, "true or false", value)
        return value

    def text(self, keys: Keys, default: Any = _MISSING) -> Any:
        """A JSON string."""
        key, value, present = self._lookup(keys, default)
        if present and not isinstance(value, str):
            raise self.bad(key, "a string", value)
        return value

    def integers(self, keys: Keys, default: Any = _MISSING, *, lo: int = 0, hi: int = MAX_COUNT) -> Any:
        """A JSON list of integers in ``[lo, hi]``."""
        key, value, present = self._lookup(keys, default)
        if present and (not isinstance(value, list) or not all(type(v) is int and lo <= v <= hi for v in value)):
            raise self.bad(key, f"a list of integers in [{lo}, {hi}]", value)
        return value

    def section(self, key: str) -> "HFConfigReader":
        """A reader of the object under ``key`` (``{}`` when absent or null) whose errors name
        ``key.field``; its refusals go to this reader."""
        _, value, _ = self._lookup(key, {})
        if not isinstance(value, dict):
            raise self.bad(key, "an object or null", value)
        sub = HFConfigReader(value, self.source, self.arch, prefix=f"{self.prefix}{key}.")
        sub.problems = self.problems
        return sub

    def refuse(self, ok: bool, what: str) -> None:
        """Note ``what`` (a phrase naming the field and its value) unless ``ok``."""
        if not ok:
            self.problems.append(what)

    def finish(self) -> None:
        if self.problems:
            raise ConversionError(
                f"{self.source}: {self.arch} config cannot be expressed by our model: {'; '.join(self.problems)}"
            )


def model_type_of(d: dict[str, Any], source: str) -> str | None:
    """``config.json``'s ``model_type`` (a string, or None when absent / null)."""
    value = d.get("model_type")
    if value is not None and not isinstance(value, str):
        raise ConversionError(f"{source}: config.json: 'model_type' must be a string, got {short_repr(value)}")
    return value


def hf_classes_of(d: dict[str, Any], source: str) -> list[str]:
    """``config.json``'s ``architectures`` (a list of class names; empty when absent / null)."""
    value = d.get("architectures")
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConversionError(
            f"{source}: config.json: 'architectures' must be a list of strings, got {short_repr(value)}"
        )
    return value


def common_to_hf(c: ModelShape, model_type: str, hf_class: str) -> dict[str, Any]:
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
    """``ModelShape`` keyword arguments from the shared fields, each type- and bound-checked;
    notes what we cannot express."""
    heads = r.integer("num_attention_heads", hi=MAX_COUNT)
    hidden = r.integer("hidden_size")
    layers = r.integer("num_hidden_layers", hi=MAX_COUNT)
    vocab = r.integer("vocab_size")
    groups = r.integer("num_key_value_heads", heads, hi=MAX_COUNT)
    head_dim = r.integer("head_dim", hidden // heads)
    if heads * head_dim > MAX_WIDTH:
        raise r.bad(
            "head_dim", f"at most {MAX_WIDTH} // num_attention_heads ({heads}) = {MAX_WIDTH // heads}", head_dim
        )
    act = r.text("hidden_act", "silu")
    r.refuse(act in ("silu", "swish"), f"hidden_act={act!r} (only SwiGLU with silu)")
    return {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_layers": layers,
        "num_attention_heads": heads,
        "num_query_groups": groups,
        "kv_channels": head_dim,
        **read_rope(r, allow_yarn=False),
        "norm_epsilon": r.number("rms_norm_eps", 1e-6, lo=0.0, hi=1.0, below=True),
        "seq_length": r.integer("max_position_embeddings", 2048, hi=MAX_POSITIONS),
        "tie_embeddings": r.flag("tie_word_embeddings", tie_default),
    }


def read_rope(r: HFConfigReader, *, allow_yarn: bool) -> dict[str, Any]:
    """The RoPE fields of our model config: the base, and YaRN's when ``allow_yarn`` and the
    config stretches RoPE that way (``rope_parameters`` of transformers 5, or ``rope_scaling``
    of 4.x and DeepSeek's own configs); any other scaling is noted as inexpressible."""
    rope = r.section("rope_parameters")
    _, scaling, _ = r._lookup("rope_scaling", None)
    if scaling is not None and not isinstance(scaling, dict):
        raise r.bad("rope_scaling", "an object or null", scaling)
    rope_type = rope.text(("rope_type", "type"), "default")
    scaled = r.section("rope_scaling")
    scaling_type = scaled.text(("rope_type", "type"), "default")
    theta = rope.number("rope_theta", r.number("rope_theta", 10000.0, lo=0.0, above=True), lo=0.0, above=True)
    kinds = {rope_type, scaling_type} - {"default"}
    if allow_yarn and kinds == {"yarn"}:
        source = rope if rope_type == "yarn" else scaled
        return {
            "rotary_base": theta,
            "rope_type": "yarn",
            "rotary_scaling_factor": source.number("factor", lo=1.0),
            "original_max_position_embeddings": source.integer("original_max_position_embeddings", hi=MAX_POSITIONS),
            "beta_fast": source.number("beta_fast", 32.0, lo=0.0, above=True),
            "beta_slow": source.number("beta_slow", 1.0, lo=0.0, above=True),
            "mscale": source.number("mscale", 1.0, lo=0.0),
            "mscale_all_dim": source.number("mscale_all_dim", 0.0, lo=0.0),
        }
    allowed = "plain RoPE or YaRN" if allow_yarn else "only plain RoPE"
    r.refuse(rope_type == "default", f"rope_parameters.rope_type={rope_type!r} ({allowed})")
    r.refuse(scaling_type == "default", f"rope_scaling={short_repr(scaling)} ({allowed})")
    return {"rotary_base": theta}


#: the ``config.json`` fields each ``ModelShape`` field is read from, to name them in its errors
_HF_FIELDS = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "num_layers": "num_hidden_layers",
    "num_attention_heads": "num_attention_heads",
    "num_query_groups": "num_key_value_heads",
    "kv_channels": "head_dim",
    "ffn_hidden_size": "intermediate_size",
    "seq_length": "max_position_embeddings",
    "num_experts": "num_experts",
    "moe_router_topk": "num_experts_per_tok",
    "moe_ffn_hidden_size": "moe_intermediate_size",
    "moe_router_num_groups": "n_group",
    "moe_router_group_topk": "topk_group",
    "first_k_dense_replace": "first_k_dense_replace",
    "kv_lora_rank": "kv_lora_rank",
    "q_lora_rank": "q_lora_rank",
    "layer_kinds": "layer_types",
}


def model_config(r: HFConfigReader, kwargs: dict[str, Any]) -> ModelShape:
    """Raise for everything noted so far, then build the config (its own checks become a
    :class:`ConversionError` too, naming the ``config.json`` fields involved)."""
    r.finish()
    try:
        return ModelShape(**kwargs)
    except ValueError as e:
        named = [hf for ours, hf in _HF_FIELDS.items() if ours in str(e)]
        fields = f" (config.json: {', '.join(named)})" if named else ""
        raise ConversionError(f"{r.source}: {r.arch} config is not a valid model config: {e}{fields}") from None
