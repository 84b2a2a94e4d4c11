"""One check of a Hugging Face ``config.json`` before any model is built from it, without torch or
transformers (the launcher's pre-flight calls it before it imports either).

A ``config.json`` comes from anywhere: a model directory (``mfsdp-train --hf-model DIR``), the
``model_source`` record of a checkpoint (``--resume``, ``--init-from``, ``export-hf``). Left to
transformers and torch, a hostile value ends in a traceback far away (``num_attention_heads = 0``:
a division by zero), is built as asked (``num_hidden_layers = 10**6`` builds for minutes, a
``vocab_size`` of 10**9 allocates what it says) or is trained with (``rope_theta`` NaN).
:func:`check_hf_config` refuses such a config, one :class:`~mfsdp_ckpt.errors.ConversionError`
line naming the file and the field (``DIR/config.json: num_attention_heads = 0 must be a positive
integer``): every size and count a JSON integer (not a bool, a float or a string) in its bounds,
the divisions the architectures make exact, every epsilon and RoPE base a finite positive number.
:func:`estimated_param_bytes` then says what the model would hold, which :func:`check_model_fits`
compares with the machine's memory and with the weights the directory or checkpoint holds.

``auto_map`` and ``trust_remote_code`` name code to import: never honoured here, and
:func:`without_remote_code` drops them from every config this project records or exports.
"""

from __future__ import annotations

import json
import math
import os
import stat
from typing import Any, Mapping

from mfsdp_ckpt.errors import ConversionError, one_line
from mfsdp_ckpt.storage import fs

__all__ = [
    "MAX_LAYERS",
    "MAX_COUNT",
    "MAX_WIDTH",
    "MAX_POSITIONS",
    "MAX_CONFIG_BYTES",
    "REMOTE_CODE_KEYS",
    "check_hf_config",
    "estimated_params",
    "estimated_param_bytes",
    "check_model_fits",
    "check_against_tensors",
    "check_hf_model_dir",
    "read_config_json",
    "safetensors_bytes",
    "machine_memory",
    "without_remote_code",
]

#: the most decoder layers a config may declare: 16 times the deepest released model, and few
#: enough that transformers builds them in seconds (about a millisecond a layer, even on ``meta``)
MAX_LAYERS = 2**12
#: the most attention heads, key/value heads, experts or experts per token a config may declare
MAX_COUNT = 2**16
#: the widest dimension (vocabulary, hidden, FFN, head dimension, all heads together): far above
#: any real model, low enough that no product of two widths overflows torch's 64-bit sizes
MAX_WIDTH = 2**24
#: the longest context a config may declare (16 Mi tokens; models that learn positions hold a row each)
MAX_POSITIONS = 2**24
#: the largest ``config.json`` read (real ones are a few kilobytes)
MAX_CONFIG_BYTES = 16 * 1024 * 1024
#: the largest integer literal parsed (longer ones are refused before ``int()`` works on them)
MAX_INT_DIGITS = 100
#: the bytes each parameter takes in the model the trainer builds (fp32 main weights)
PARAM_ITEMSIZE = 4
#: the fields that name code to import (transformers' ``trust_remote_code`` path)
REMOTE_CODE_KEYS = ("auto_map", "trust_remote_code")

#: integer fields: (lowest allowed, highest allowed); absent or null means unset
_INTEGERS: dict[str, tuple[int, int]] = {
    "vocab_size": (1, MAX_WIDTH),
    "hidden_size": (1, MAX_WIDTH),
    "intermediate_size": (1, MAX_WIDTH),
    "num_hidden_layers": (1, MAX_LAYERS),
    "num_attention_heads": (1, MAX_COUNT),
    "num_key_value_heads": (1, MAX_COUNT),
    "head_dim": (1, MAX_WIDTH),
    "max_position_embeddings": (1, MAX_POSITIONS),
    "num_experts": (1, MAX_COUNT),
    "num_local_experts": (1, MAX_COUNT),
    "n_routed_experts": (1, MAX_COUNT),
    "num_experts_per_tok": (1, MAX_COUNT),
    "n_shared_experts": (0, MAX_COUNT),
    "moe_intermediate_size": (1, MAX_WIDTH),
    "shared_expert_intermediate_size": (0, MAX_WIDTH),
    "decoder_sparse_step": (1, MAX_LAYERS),
    "first_k_dense_replace": (0, MAX_LAYERS),
    "kv_lora_rank": (1, MAX_WIDTH),
    "q_lora_rank": (1, MAX_WIDTH),
    "qk_rope_head_dim": (1, MAX_WIDTH),
    "qk_nope_head_dim": (1, MAX_WIDTH),
    "v_head_dim": (1, MAX_WIDTH),
    "n_group": (1, MAX_COUNT),
    "topk_group": (1, MAX_COUNT),
}
#: float fields that must be finite and > 0 (epsilons, RoPE bases and factors)
_POSITIVE_FLOATS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps", "rope_theta")
#: the same, inside ``rope_parameters`` / ``rope_scaling``
_ROPE_FLOATS = ("rope_theta", "factor")
#: the expert-count fields, in the order the families name them
_EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts")


def _is_set(config: Mapping[str, Any], key: str) -> bool:
    return key in config and config[key] is not None


def _shown(value: Any) -> str:
    """``value`` for a message: JSON's spelling, cut short (a hostile value is named, not echoed)."""
    try:
        text = json.dumps(value, allow_nan=True)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:60] + "..."


def _check_integer(value: Any, lo: int, hi: int, where: str, name: str) -> None:
    what = "a positive integer" if lo == 1 else "a non-negative integer"
    if type(value) is not int or value < lo:
        raise ConversionError(f"{where}: {name} = {_shown(value)} must be {what}")
    if value > hi:
        raise ConversionError(f"{where}: {name} = {value} must be {what} of at most {hi}")


def _check_integers(config: Mapping[str, Any], where: str, prefix: str) -> None:
    """Each field of :data:`_INTEGERS` set: an integer in its bounds, or (a per-layer value, as
    Gemma 3n's ``intermediate_size``) a list of at most :data:`MAX_LAYERS` of them."""
    for key, (lo, hi) in _INTEGERS.items():
        if not _is_set(config, key):
            continue
        value = config[key]
        if isinstance(value, list) and 0 < len(value) <= MAX_LAYERS:
            for i, item in enumerate(value):
                _check_integer(item, lo, hi, where, f"{prefix}{key}[{i}]")
        else:
            _check_integer(value, lo, hi, where, f"{prefix}{key}")


def _check_number(value: Any, where: str, name: str) -> None:
    if type(value) not in (int, float) or not math.isfinite(float(value)) or value <= 0:
        raise ConversionError(f"{where}: {name} = {_shown(value)} must be a finite number > 0")


def _check_floats(config: Mapping[str, Any], where: str, prefix: str) -> None:
    """The epsilons and RoPE bases, at the top level and in the RoPE sections (transformers 5 may
    keep one ``rope_parameters`` section per layer type: each is checked)."""
    for key in _POSITIVE_FLOATS:
        if _is_set(config, key):
            _check_number(config[key], where, f"{prefix}{key}")
    for section in ("rope_parameters", "rope_scaling"):
        value = config.get(section)
        if value is None:
            continue
        if not isinstance(value, dict):
            raise ConversionError(f"{where}: {prefix}{section} = {_shown(value)} must be an object or null")
        parts = [(f"{section}.{k}.", v) for k, v in value.items() if isinstance(v, dict)] or [(f"{section}.", value)]
        for name, part in parts:
            for key in _ROPE_FLOATS:
                if _is_set(part, key):
                    _check_number(part[key], where, f"{prefix}{name}{key}")


def _single(config: Mapping[str, Any], key: str) -> int | None:
    """``config[key]`` when it is one (checked) integer; None when unset or per-layer (a list)."""
    value = config.get(key)
    return value if type(value) is int else None


def _check_ratios(config: Mapping[str, Any], where: str, prefix: str) -> None:
    """The divisions the architectures make: heads over the hidden size (unless ``head_dim`` is
    given), query heads over key/value heads, experts per token within the experts, all heads'
    width within :data:`MAX_WIDTH`."""
    heads, hidden = _single(config, "num_attention_heads"), _single(config, "hidden_size")
    kv, head_dim = _single(config, "num_key_value_heads"), _single(config, "head_dim")
    mla = _is_set(config, "kv_lora_rank")  # DeepSeek's latent attention: its own head widths
    if heads is not None and hidden is not None and head_dim is None and not mla and hidden % heads:
        raise ConversionError(
            f"{where}: {prefix}hidden_size = {hidden} must be a multiple of {prefix}num_attention_heads = {heads} "
            "(no head_dim is given)"
        )
    if heads is not None and kv is not None and heads % kv:
        raise ConversionError(
            f"{where}: {prefix}num_key_value_heads = {kv} must divide {prefix}num_attention_heads = {heads}"
        )
    if heads is not None and head_dim is not None and heads * head_dim > MAX_WIDTH:
        raise ConversionError(
            f"{where}: {prefix}head_dim = {head_dim} must be at most {MAX_WIDTH} // num_attention_heads ({heads})"
        )
    experts = next((_single(config, k) for k in _EXPERTS if _single(config, k)), None)
    topk = _single(config, "num_experts_per_tok")
    if experts is not None and topk is not None and topk > experts:
        raise ConversionError(
            f"{where}: {prefix}num_experts_per_tok = {topk} must be at most the number of experts ({experts})"
        )


def check_hf_config(config: Mapping[str, Any], where: str, prefix: str = "") -> None:
    """Refuse a ``config.json`` mapping a model must not be built from: one
    :class:`~mfsdp_ckpt.errors.ConversionError` line, ``{where}: {prefix}{field} = {value} must be
    ...``. Checked: every size and count of :data:`_INTEGERS` a JSON integer (never a bool) in its
    bounds; epsilons, ``rope_theta`` and the RoPE sections' ``rope_theta`` / ``factor`` finite and
    > 0; ``hidden_size % num_attention_heads == 0`` unless ``head_dim`` is given,
    ``num_attention_heads % num_key_value_heads == 0``, ``num_experts_per_tok`` within the
    experts. Absent or null fields are left to the architecture's defaults. ``where`` names the
    file (``DIR/config.json``, or a checkpoint), ``prefix`` the record inside it."""
    if not isinstance(config, Mapping):
        raise ConversionError(f"{where}: {prefix or 'config'} must be a JSON object, got {_shown(config)}")
    if _is_set(config, "kv_lora_rank") and config.get("head_dim") == 0:
        config = {k: v for k, v in config.items() if k != "head_dim"}  # unused by latent attention (GLM-5's 0)
    _check_integers(config, where, prefix)
    _check_floats(config, where, prefix)
    _check_ratios(config, where, prefix)


def _int(config: Mapping[str, Any], key: str, default: int = 0) -> int:
    """``config[key]`` when it is a non-negative integer (checked or not), else ``default``."""
    value = config.get(key)
    return value if type(value) is int and value >= 0 else default


def _attention_params(config: Mapping[str, Any], hidden: int) -> int:
    """One layer's attention: q, k, v and o projections (MLA's low-rank ones where configured)."""
    heads = _int(config, "num_attention_heads", 1) or 1
    kv_heads = _int(config, "num_key_value_heads", heads) or heads
    head_dim = _int(config, "head_dim") or hidden // heads
    if _is_set(config, "kv_lora_rank"):  # DeepSeek's multi-head latent attention
        rope, nope = _int(config, "qk_rope_head_dim"), _int(config, "qk_nope_head_dim")
        v_dim, kv_rank, q_rank = (
            _int(config, "v_head_dim", head_dim),
            _int(config, "kv_lora_rank"),
            _int(config, "q_lora_rank"),
        )
        q = hidden * q_rank + q_rank * heads * (rope + nope) if q_rank else hidden * heads * (rope + nope)
        kv = hidden * (kv_rank + rope) + kv_rank * heads * (nope + v_dim)
        return q + kv + heads * v_dim * hidden
    return 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim


def _moe_layers(config: Mapping[str, Any], layers: int) -> int:
    """How many of ``layers`` hold experts: all but DeepSeek's first dense ones, Qwen's
    ``mlp_only_layers``, and those ``decoder_sparse_step`` skips."""
    first_dense = _int(config, "first_k_dense_replace")
    step = _int(config, "decoder_sparse_step", 1) or 1
    dense_only = config.get("mlp_only_layers")
    dense = {i for i in dense_only if type(i) is int} if isinstance(dense_only, list) else set()
    return sum(1 for i in range(first_dense, layers) if i not in dense and (i + 1) % step == 0)


def _mlp_params(config: Mapping[str, Any], hidden: int, layers: int) -> int:
    """Every layer's MLP: gated (three matrices), dense or per expert, with the router and the
    shared experts of the families that have them."""
    ffn = _int(config, "intermediate_size")
    experts = next((_int(config, k) for k in _EXPERTS if _int(config, k)), 0)
    if not experts:
        return layers * 3 * hidden * ffn
    moe = _moe_layers(config, layers)
    expert_ffn = _int(config, "moe_intermediate_size") or ffn
    shared = _int(config, "n_shared_experts") * expert_ffn + _int(config, "shared_expert_intermediate_size")
    per_moe_layer = experts * 3 * hidden * expert_ffn + hidden * experts + 3 * hidden * shared
    return moe * per_moe_layer + (layers - moe) * 3 * hidden * ffn


def estimated_params(config: Mapping[str, Any]) -> int:
    """About how many parameters the decoder ``config`` describes: the embedding and the output
    layer (one matrix when ``tie_word_embeddings`` is true), then per layer its attention, its
    MLP or experts and its norms. Fields that are absent count as nothing, so this is a lower
    bound for a config that leaves sizes to the architecture's defaults (check the config
    transformers makes of it for the whole figure)."""
    vocab, hidden, layers = _int(config, "vocab_size"), _int(config, "hidden_size"), _int(config, "num_hidden_layers")
    embeddings = vocab * hidden * (1 if config.get("tie_word_embeddings") is True else 2)
    per_layer = _attention_params(config, hidden) + 2 * hidden
    return embeddings + layers * per_layer + _mlp_params(config, hidden, layers) + hidden


def estimated_param_bytes(config: Mapping[str, Any]) -> int:
    """The bytes of the parameters :func:`estimated_params` counts, in fp32 (what the trainer
    builds: its main weights are fp32 whatever the dtype it computes in)."""
    return estimated_params(config) * PARAM_ITEMSIZE


def machine_memory() -> int | None:
    """This machine's physical memory in bytes (``SC_PHYS_PAGES * SC_PAGE_SIZE``), None where the
    platform does not say. The total, not what is free now: every rank of a job compares with the
    same figure, so they all decide alike."""
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None
    return pages * size if pages > 0 and size > 0 else None


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n < 2**40 else f"{n / 2**40:.1f} TiB"


def _sizes(config: Mapping[str, Any], prefix: str) -> str:
    """The fields behind an estimate, for a message: ``vocab_size=…, hidden_size=…``."""
    keys = ("vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size", *_EXPERTS, "moe_intermediate_size")
    return ", ".join(f"{prefix}{k}={config[k]}" for k in keys if _is_set(config, k))


def check_model_fits(
    config: Mapping[str, Any],
    where: str,
    *,
    weights_bytes: int | None = None,
    memory: int | None = None,
    prefix: str = "",
) -> None:
    """Refuse a (checked) config whose model holds far more than there is: its fp32 parameters
    (:func:`estimated_param_bytes`) more than ``memory`` (default: :func:`machine_memory`), or,
    when ``weights_bytes`` says what the weights to load take on disk, more parameters than those
    bytes could hold twice over at one byte a parameter (no stored dtype is smaller). One
    :class:`~mfsdp_ckpt.errors.ConversionError` line naming ``where`` and the fields behind the
    estimate."""
    params = estimated_params(config)
    if weights_bytes is not None and params > 2 * weights_bytes:
        raise ConversionError(
            f"{where}: the config describes a model of about {params:,} parameters ({_sizes(config, prefix)}), "
            f"far more than the {weights_bytes:,} bytes of weights present hold"
        )
    memory = machine_memory() if memory is None else memory
    needed = estimated_param_bytes(config)
    if memory is not None and needed > memory:
        raise ConversionError(
            f"{where}: the config describes a model of about {params:,} parameters ({_sizes(config, prefix)}): "
            f"{_gib(needed)} in fp32, more than this machine's memory ({_gib(memory)})"
        )


# ---- a config against the tensors it is written with -----------------------------------------
_EMBEDDINGS = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight")


def _layer_of(name: str) -> int | None:
    """The decoder layer index in a parameter name (``….layers.N.…``), else None."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part == "layers" and parts[i + 1].isdigit() and len(parts[i + 1]) <= 9:
            return int(parts[i + 1])
    return None


def _layers_shown(held: set[int]) -> str:
    if not held:
        return "no decoder layers"
    if held == set(range(len(held))):
        return f"{len(held)} decoder layers"
    return f"decoder layers {', '.join(str(i) for i in sorted(held)[:4])}{' ...' if len(held) > 4 else ''}"


def _check_matrix(
    config: Mapping[str, Any], name: str, shape: tuple[int, ...], fields: tuple[str, str], where: str, prefix: str
) -> None:
    """``shape`` of the 2-D tensor ``name`` is ``(config[fields[0]], config[fields[1]])`` for those set."""
    for dim, key in enumerate(fields):
        if _is_set(config, key) and (len(shape) != 2 or shape[dim] != config[key]):
            raise ConversionError(f"{where}: {prefix}{key} = {config[key]} does not match {name} {tuple(shape)}")


def check_against_tensors(
    config: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], where: str, prefix: str = ""
) -> None:
    """Refuse a (checked) config that does not describe the tensors ``shapes`` (name -> shape) it
    is to be written with: the input embedding (``…embed_tokens.weight``, required) and the
    output layer are ``(vocab_size, hidden_size)``, the decoder layers held are exactly
    ``num_hidden_layers``, each dense ``mlp.gate_proj`` has ``intermediate_size`` rows and each
    fused expert tensor ``num_experts`` experts. One ConversionError line naming the field."""
    embeddings = [n for n in shapes if n.endswith(_EMBEDDINGS) and len(shapes[n]) == 2]
    if not embeddings:
        raise ConversionError(
            f"{where}: no input embedding (…embed_tokens.weight) to check {prefix}vocab_size and hidden_size against"
        )
    for name in [*embeddings, *(n for n in shapes if n not in embeddings)]:  # the embedding named first
        shape = tuple(shapes[name])
        if name in embeddings or name.endswith("lm_head.weight"):
            _check_matrix(config, name, shape, ("vocab_size", "hidden_size"), where, prefix)
        elif name.endswith(".mlp.gate_proj.weight") and _is_set(config, "intermediate_size"):
            if shape[:1] != (config["intermediate_size"],):
                raise ConversionError(
                    f"{where}: {prefix}intermediate_size = {config['intermediate_size']} does not match {name} {shape}"
                )
        elif name.endswith(".experts.gate_up_proj") and len(shape) == 3:
            experts = next(((k, config[k]) for k in _EXPERTS if _is_set(config, k)), None)
            if experts is not None and shape[0] != experts[1]:
                raise ConversionError(f"{where}: {prefix}{experts[0]} = {experts[1]} does not match {name} {shape}")
    held = {i for i in map(_layer_of, shapes) if i is not None}
    layers = config.get("num_hidden_layers")
    if layers is not None and held != set(range(layers)):
        raise ConversionError(
            f"{where}: {prefix}num_hidden_layers = {layers}, but the tensors hold {_layers_shown(held)}"
        )


# ---- reading a model directory's config, torch-free -----------------------------------------
def _bounded_int(text: str) -> int:
    if len(text) > MAX_INT_DIGITS + 1:
        raise ValueError(f"an integer of {len(text)} digits")
    return int(text)


def read_config_json(path: str, what: str = "config.json") -> dict[str, Any]:
    """The JSON object in the regular file ``path`` (at most :data:`MAX_CONFIG_BYTES`; a FIFO, a
    directory or a device is refused, never waited on), or one ConversionError line naming it
    (and ``what`` it should have been)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise ConversionError(f"{path}: cannot open {what} ({e.strerror or e})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConversionError(f"{path}: not a regular file ({what} must be one)")
        if st.st_size > MAX_CONFIG_BYTES:
            raise ConversionError(f"{path}: {st.st_size} bytes, more than the {MAX_CONFIG_BYTES} a {what} may have")
        with os.fdopen(os.dup(fd), "rb") as f:
            blob = fs.read_bounded(f, MAX_CONFIG_BYTES)
    except OSError as e:
        raise ConversionError(f"{path}: cannot read {what} ({e.strerror or e})") from None
    finally:
        os.close(fd)
    try:
        value = json.loads(blob.decode("utf-8-sig"), parse_int=_bounded_int)
    except (ValueError, RecursionError) as e:
        raise ConversionError(f"{path}: not valid JSON ({one_line(e, 120)})") from None
    if not isinstance(value, dict):
        raise ConversionError(f"{path}: not a JSON object ({type(value).__name__} at the top level)")
    return value


def safetensors_bytes(path: str) -> int | None:
    """The bytes of the ``*.safetensors`` files in the directory ``path`` (links followed, as in
    the hub's cache), None when it holds none."""
    total, found = 0, False
    try:
        names = os.listdir(path)
    except OSError:
        return None
    for name in names:
        if name.endswith(".safetensors"):
            try:
                st = os.stat(os.path.join(path, name))
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                total, found = total + st.st_size, True
    return total if found else None


def check_hf_model_dir(path: str, flag: str = "--hf-model") -> dict[str, Any]:
    """The ``config.json`` of the model directory ``path``, checked before anything is built from
    it (torch-free: the launcher's pre-flight): a directory with a regular ``config.json`` holding
    a JSON object; :func:`check_hf_config`; :func:`check_model_fits` against this machine's memory
    and the directory's safetensors files. ConversionError, one line naming the directory (after
    ``flag``), or ``path/config.json`` and the field."""
    if not os.path.isdir(path):
        raise ConversionError(f"{flag} {path}: not a directory")
    config_path = os.path.join(path, "config.json")
    if not os.path.lexists(config_path):
        raise ConversionError(f"{flag} {path}: no config.json (not a Hugging Face model directory)")
    config = read_config_json(config_path)
    check_hf_config(config, config_path)
    check_model_fits(config, config_path, weights_bytes=safetensors_bytes(path))
    return config


def without_remote_code(value: Any, depth: int = 4) -> Any:
    """``value`` (a config: dicts, lists, scalars) without any :data:`REMOTE_CODE_KEYS` entry in it
    or in the sections ``depth`` levels down (sub-configs: ``text_config``, ...; deeper nesting is
    data, and a bounded walk cannot run out of stack on a hostile one): what names code to import
    is never recorded, exported or passed to transformers."""
    if depth < 0:
        return value
    if isinstance(value, dict):
        return {k: without_remote_code(v, depth - 1) for k, v in value.items() if k not in REMOTE_CODE_KEYS}
    if isinstance(value, list):
        return [without_remote_code(v, depth - 1) for v in value]
    return value
