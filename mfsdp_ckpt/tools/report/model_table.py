"""The model of a checkpoint as people read it: family, architecture, layers, hidden size,
experts, and its parameters by kind (embeddings, attention, MLP, experts, norms, other), with
the raw config it was read from folded away (``inspect --html``'s "model" section).

Read from the manifest's ``model_source`` (a ``transformers`` model, our reference GPT, a
Megatron-Core GPTModel), from the ``hf`` record ``import-hf`` leaves, or, for a checkpoint
that records nothing, from the tensor names alone.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from mfsdp_ckpt.format.model_source import MEGATRON_CORE, TRANSFORMERS
from mfsdp_ckpt.tools.inspect import CheckpointInfo
from mfsdp_ckpt.tools.report.kinds import KINDS, layer_of, param_kind
from mfsdp_ckpt.tools.report.svg import esc

__all__ = ["KindCount", "ModelSummary", "model_summary", "model_section"]

#: a Megatron-Core ``torch_dist`` key of all layers stacked (``decoder.layers.mlp...``, layer first)
_STACKED = re.compile(r"(?:^|\.)layers\.[a-z_]")

#: config keys per fact, in the spellings of transformers, our GPTConfig and Megatron-Core's arguments
_ALIASES = {
    "layers": ("num_hidden_layers", "num_layers", "n_layer"),
    "hidden": ("hidden_size", "n_embd", "d_model"),
    "heads": ("num_attention_heads", "n_head"),
    "kv_heads": ("num_key_value_heads", "num_query_groups"),
    "experts": ("num_local_experts", "num_experts", "num_moe_experts", "n_routed_experts"),
    "topk": ("num_experts_per_tok", "moe_router_topk"),
    "ffn": ("intermediate_size", "ffn_hidden_size"),
    "moe_ffn": ("moe_intermediate_size", "moe_ffn_hidden_size"),
    "vocab": ("vocab_size", "padded_vocab_size"),
}


@dataclass
class KindCount:
    tensors: int = 0
    params: int = 0


@dataclass
class ModelSummary:
    """``facts``: (label, value) rows; ``kinds``: parameters per kind; ``raw``: (name, config) to fold."""

    facts: list[tuple[str, str]] = field(default_factory=list)
    kinds: dict[str, KindCount] = field(default_factory=dict)
    raw: list[tuple[str, Any]] = field(default_factory=list)

    @property
    def params(self) -> int:
        return sum(k.params for k in self.kinds.values())


def _get(config: dict[str, Any], fact: str) -> Any:
    for name in _ALIASES[fact]:
        value = config.get(name)
        if value not in (None, 0, ""):
            return value
    return None


def _identity(info: CheckpointInfo, manifest: dict[str, Any] | None) -> tuple[str, str, str, dict[str, Any]]:
    """(family, architecture, where the record comes from, the config holding the shape)."""
    record, manifest = info.model_source or {}, manifest or {}
    kind, config = record.get("kind"), record.get("config") or info.model_config or {}
    if kind == TRANSFORMERS:
        return str(config.get("model_type", "?")), str(record.get("class", "?")), "transformers model", config
    if kind == MEGATRON_CORE:
        args = record.get("args") or info.model_config or {}
        spec = record.get("layer_spec", "local")
        return "GPT (Megatron-Core)", f"GPTModel, {spec} spec", "Megatron-Core", args
    hf = manifest.get("hf") if isinstance(manifest.get("hf"), dict) else None
    if hf:
        where = f"imported from Hugging Face ({manifest.get('converted_from', '?')}), stored with our GPT names"
        return str(hf.get("model_type", "?")), str(hf.get("architecture", "?")), where, config
    if config:
        where = f"converted from {manifest['converted_from']}" if manifest.get("converted_from") else "mfsdp-train"
        return "GPT (mfsdp reference)", "GPTModel", where, config
    return "unknown", "unknown", "nothing recorded (shape read from the tensor names)", {}


def _parameter_tensors(info: CheckpointInfo) -> list[tuple[str, tuple[int, ...]]]:
    """(key, shape) of every model weight: the ``model.`` group, or, for a checkpoint without
    one (Megatron-Core's own, a bare stock one), every tensor that is not optimizer state."""
    model = [(t.key, t.shape) for t in info.tensors if t.group == "model" and t.shape is not None]
    if model:
        return model
    return [
        (t.key, t.shape)
        for t in info.tensors
        if t.group == "other" and t.shape is not None and not t.key.startswith("optimizer.")
    ]


def model_summary(info: CheckpointInfo, manifest: dict[str, Any] | None = None) -> ModelSummary:
    """The model table of ``info`` (``manifest``: the checkpoint's ``mfsdp.json``, for ``import-hf``'s record)."""
    family, arch, where, config = _identity(info, manifest)
    out = ModelSummary(kinds={k: KindCount() for k in KINDS})
    layers: set[int] = set()
    for key, shape in _parameter_tensors(info):
        count = out.kinds[param_kind(key)]
        count.tensors += 1
        count.params += math.prod(shape)
        if (layer := layer_of(key)) is not None:
            layers.add(layer)
        elif shape and _STACKED.search(key):  # Megatron-Core's own checkpoints stack the layers
            layers.add(shape[0] - 1)
    v = {fact: _get(config, fact) for fact in _ALIASES}
    out.facts = [("family", family), ("architecture", arch), ("source", where)]
    if v["layers"] or layers:
        out.facts.append(("layers", str(v["layers"] or f"{max(layers) + 1} (read from the tensors)")))
    if v["hidden"]:
        ffn = f", FFN {v['ffn']}" if v["ffn"] else ""
        out.facts.append(("hidden size", f"{v['hidden']}{ffn}"))
    if v["heads"]:
        kv = f" ({v['kv_heads']} key/value)" if v["kv_heads"] and v["kv_heads"] != v["heads"] else ""
        out.facts.append(("attention heads", f"{v['heads']}{kv}"))
    if v["experts"]:
        topk = f", top {v['topk']} per token" if v["topk"] else ""
        ffn = f", expert FFN {v['moe_ffn']}" if v["moe_ffn"] else ""
        out.facts.append(("experts", f"{v['experts']}{topk}{ffn}"))
    if v["vocab"]:
        out.facts.append(("vocabulary", str(v["vocab"])))
    out.facts.append(("parameters", f"{out.params:,} in {sum(k.tensors for k in out.kinds.values())} tensors"))
    out.raw = _raw(info)
    return out


def _raw(info: CheckpointInfo) -> list[tuple[str, Any]]:
    """The recorded configs, each once: the model source record, and ``model_config`` only where
    it is not that record's own config (a Megatron-Core run records both)."""
    record = info.model_source
    raw: list[tuple[str, Any]] = [("model_source", record)] if record else []
    if info.model_config and (not record or record.get("config") != info.model_config):
        raw.append(("model_config", info.model_config))
    return raw


def model_section(summary: ModelSummary) -> str:
    """The "model" section: the facts, a table of parameters by kind, the raw config folded."""
    facts = "".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in summary.facts)
    total = summary.params or 1
    rows = "".join(
        f'<tr data-kind="{esc(kind)}"><td>{esc(kind)}</td><td class=num>{c.tensors}</td>'
        f"<td class=num>{c.params:,}</td><td class=num>{100 * c.params / total:.1f}%</td>"
        f'<td><span class="share" style="width:{round(120 * c.params / total)}px"></span></td></tr>'
        for kind, c in summary.kinds.items()
        if c.tensors
    )
    head = (
        "<tr><th>kind</th><th class=num>tensors</th><th class=num>parameters</th><th class=num>share</th><th></th></tr>"
    )
    kinds = f'<table class="kinds">{head}{rows}</table>'
    raw = "".join(
        f"<p class=note>{esc(name)}</p><pre>{esc(json.dumps(value, indent=1, sort_keys=True))}</pre>"
        for name, value in summary.raw
    )
    folded = (
        f'<details class="raw-config"><summary>raw config ({esc(", ".join(n for n, _ in summary.raw))})</summary>'
        f"{raw}</details>"
        if summary.raw
        else ""
    )
    return f'<h2 id="model">model</h2><div class="side"><table class="model">{facts}</table>{kinds}</div>{folded}'
