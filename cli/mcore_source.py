"""The trainer's Megatron-Core family (``--mcore-config FILE.json``): a genuine MCore ``GPTModel``
trained under our ``fully_shard``.

``FILE.json`` is what ``mfsdp-ckpt import-mcore --config`` reads: MCore's arguments under
Megatron-LM's names (``num_layers``, ``hidden_size``, ``num_attention_heads``,
``num_query_groups``, ``kv_channels``, ``ffn_hidden_size``, ``vocab_size``, ``seq_length``,
``rotary_base``, ``norm_epsilon``, ``untie_embeddings_and_output_weights``, ``num_experts``,
``moe_router_topk``, ``moe_ffn_hidden_size``, ...) and/or ``TransformerConfig`` field names
(``layernorm_epsilon``, ``num_moe_experts``, ``init_method_std``, ``hidden_dropout``, ...); other
names are ignored, so a dump of Megatron-LM's whole ``args`` works. ``transformer_impl``
(``local`` or ``transformer_engine``) picks the layer spec; default: Transformer Engine's where it
imports and CUDA is there, else MCore's local spec.

What our reference model computes is assumed where the file says nothing (RMSNorm, SwiGLU, RoPE,
no linear biases, dropout 0, MCore's default of tied embeddings, no aux loss) and what it cannot
compute is refused, as by ``import-mcore``: checkpoints of these runs carry the equivalent
``GPTConfig`` as ``model_config``, so ``export-mcore``, ``export-hf``, ``reshard`` and
``--init-from`` into the reference model work on them. TP, PP and CP are 1 (refused otherwise); EP
is ``--ep`` (the file's ``expert_model_parallel_size`` is ignored). MoE layers use the
``allgather`` token dispatcher without grouped GEMM, which run on CPU.
"""

from __future__ import annotations

import dataclasses
import math
import os
import typing
from typing import Any

import torch
from torch import nn

from mfsdp_ckpt.errors import ConversionError, one_line
from mfsdp_ckpt.format.model_source import MEGATRON_CORE, model_source_of
from mfsdp_ckpt.mcore.config import infer_config, read_config_file
from mfsdp_ckpt.mcore.config_check import check_fits_memory, check_mcore_config, estimate_parameters
from mfsdp_core import rename_params
from mfsdp_core.expert_parallel import ExpertMesh
from mfsdp_core.models import mcore
from mfsdp_core.models.gpt import GPTConfig, GPTModel
from mfsdp_core.plan import PlacementFn

from .model_base import ModelSource

__all__ = ["McoreSource", "INSTALL_HINT"]

INSTALL_HINT = "pip install 'mfsdp-ckpt[mcore]'"
SPECS = ("local", "transformer_engine")

#: Megatron-LM argument -> TransformerConfig field, where they differ
_TC_NAMES = {
    "norm_epsilon": "layernorm_epsilon",
    "num_experts": "num_moe_experts",
    "moe_shared_expert_intermediate_size": "moe_shared_expert_intermediate_size",
}
#: parallel sizes this family runs with 1 only (the ranks are data and expert parallel)
_MUST_BE_ONE = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "context_parallel_size",
    "expert_tensor_parallel_size",
    "virtual_pipeline_model_parallel_size",
)
#: the most a TransformerConfig field taken as given may count (no default of MCore 0.16 is negative or over 2**20)
MAX_PASSED_INT = 1 << 24
#: TransformerConfig fields set here from the model's arguments or fixed, never taken as given
_OURS = {
    "expert_model_parallel_size",
    "params_dtype",
    "pipeline_dtype",
    "use_cpu_initialization",
    "activation_func",
    "gated_linear_unit",
    "bias_activation_fusion",
    "normalization",
    "add_bias_linear",
    "moe_grouped_gemm",
    "perform_initialization",
}


def _require_megatron(where: str) -> None:
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        raise ValueError(f"{where}: megatron-core is not installed ({INSTALL_HINT})") from None


def _fits(value: Any, hint: Any) -> bool:
    """Whether the JSON value ``value`` is one of type ``hint`` (a ``TransformerConfig`` field's):
    booleans are not integers, numbers are finite; a type a JSON file cannot give (a callable, a
    dtype, an enum, a config object) takes nothing."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if origin is typing.Union or type(hint).__name__ == "UnionType":
        return any(_fits(value, h) for h in args)
    if origin is typing.Literal:
        return any(type(value) is type(a) and value == a for a in args)
    if hint in (bool, str, type(None)):
        return type(value) is hint
    if hint is int:
        return type(value) is int
    if hint is float:
        return type(value) in (int, float) and math.isfinite(value)
    if origin in (list, tuple) or hint in (list, tuple):
        if not isinstance(value, list):
            return False
        if origin is tuple and args:
            return len(args) == len(value) and all(_fits(v, h) for v, h in zip(value, args))
        item = args[0] if args else str | int | float | bool
        return all(_fits(v, item) for v in value)
    return False


def _check_passed(passed: dict[str, Any], where: str) -> None:
    """Refuse, naming it, a ``TransformerConfig`` field the arguments give (and the model takes as
    given) with a value not of its type: Megatron-Core would fail on it somewhere in the build."""
    from megatron.core.transformer import TransformerConfig

    try:
        hints = typing.get_type_hints(TransformerConfig)
    except Exception:  # noqa: BLE001 - annotations this Python cannot resolve: MCore checks what it can
        return
    for name, value in passed.items():
        if type(value) is int and not 0 <= value <= MAX_PASSED_INT:
            raise ValueError(f"{where}: {name}={value!r}: expected an integer in [0, {MAX_PASSED_INT}]")
        if value is not None and name in hints and not _fits(value, hints[name]):
            shown = " ".join(repr(value).split())
            shown = shown if len(shown) <= 60 else shown[:57] + "..."
            hint = hints[name]
            kind = hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")
            raise ValueError(f"{where}: {name}={shown}: not a value of Megatron-Core's {name} ({kind})")


def _default_spec() -> str:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return "local"
    return "transformer_engine" if torch.cuda.is_available() else "local"


class McoreSource(ModelSource):
    """A Megatron-Core ``GPTModel`` of the MCore arguments ``args`` (read from ``where``, named in
    errors), with layer spec ``layer_spec`` (``local`` / ``transformer_engine``; default: see the
    module docstring). ValueError, one line naming ``where``: megatron-core missing (naming the
    extra), an argument our model cannot express, a parallel size other than 1."""

    kind = MEGATRON_CORE

    def __init__(
        self, args: dict[str, Any], where: str, layer_spec: str | None = None, name: str = "megatron-core"
    ) -> None:
        try:
            check_mcore_config(args, where)
        except ConversionError as e:
            raise ValueError(str(e)) from None
        _require_megatron(where)
        self.args, self.where, self.name = dict(args), where, name
        spec = layer_spec or self.args.get("transformer_impl") or _default_spec()
        if spec not in SPECS:
            raise ValueError(f"{where}: transformer_impl={spec!r}: expected one of {', '.join(SPECS)}")
        if spec == "transformer_engine":
            try:
                import transformer_engine  # noqa: F401
            except ImportError:
                raise ValueError(
                    f"{where}: transformer_impl='transformer_engine' but Transformer Engine is not installed"
                ) from None
        self.layer_spec = spec
        for key in _MUST_BE_ONE:
            if self.args.get(key) not in (None, 1):
                raise ValueError(
                    f"{where}: {key}={self.args[key]!r}: only 1 is supported (ranks are data and expert "
                    "parallel; use --ep for experts)"
                )
        if self.args.get("moe_grouped_gemm") and spec == "local":
            raise ValueError(
                f"{where}: moe_grouped_gemm=true needs the transformer_engine spec (the local spec's legacy "
                "GroupedMLP has no per-expert weights)"
            )
        _check_passed(self._passed(), where)
        self.config = self._gpt_config()
        try:  # before anything is built: each process builds the whole model before sharding it
            check_fits_memory(self.config.to_dict(), where)
        except ConversionError as e:
            raise ValueError(str(e)) from None
        self.transformer_config()  # MCore's own checks of the arguments, now rather than in the build
        self.vocab_size, self.seq_length, self.num_experts = (
            self.config.vocab_size,
            self.config.seq_length,
            self.config.num_experts,
        )

    # ---- construction ----------------------------------------------------------------------
    @classmethod
    def from_file(cls, path: str) -> "McoreSource":
        """The source of ``--mcore-config path``."""
        where = f"--mcore-config {path}"
        try:
            args = read_config_file(path)
        except ConversionError as e:
            raise ValueError(f"--mcore-config {e}") from None
        return cls(args, where, name=os.path.basename(path))

    @classmethod
    def from_record(cls, record: dict[str, Any], where: str) -> "McoreSource":
        args = record.get("args")
        if not isinstance(args, dict):
            raise ValueError(f"{where}: model_source.args is not a JSON object of MCore arguments")
        try:
            check_mcore_config(args, f"{where}: model_source.args")
        except ConversionError as e:
            raise ValueError(str(e)) from None
        return cls(args, where, record.get("layer_spec"), name=str(record.get("name") or "megatron-core"))

    def _arg(self, *names: str, default: Any = None) -> Any:
        return next((self.args[n] for n in names if self.args.get(n) is not None), default)

    def _gpt_config(self) -> GPTConfig:
        """The reference model's config of these arguments: the shapes MCore gives the weights,
        checked and completed by ``import-mcore``'s inference (which refuses what our model cannot
        compute)."""
        a = self._arg
        given = dict(self.args)
        given["moe_aux_loss_coeff"] = float(a("moe_aux_loss_coeff", default=0.0))  # MCore's default: no aux loss
        given.setdefault("untie_embeddings_and_output_weights", False)  # MCore's default: tied
        layers, hidden, vocab = a("num_layers"), a("hidden_size"), a("padded_vocab_size", "vocab_size")
        heads = a("num_attention_heads")
        for name, value in (
            ("num_layers", layers),
            ("hidden_size", hidden),
            ("vocab_size", vocab),
            ("num_attention_heads", heads),
        ):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{self.where}: {name} is needed (a positive integer), got {value!r}")
        groups = heads if a("group_query_attention") is False else a("num_query_groups", default=heads)
        channels = a("kv_channels", default=hidden // heads)
        experts = a("num_experts", "num_moe_experts", default=0)
        shapes: dict[str, tuple[int, ...]] = {
            "embedding.word_embeddings.weight": (vocab, hidden),
            "decoder.layers.self_attention.linear_qkv.weight": (layers, (heads + 2 * groups) * channels, hidden),
            "decoder.layers.self_attention.linear_proj.weight": (layers, hidden, heads * channels),
        }
        if experts:
            moe_ffn = a("moe_ffn_hidden_size", "ffn_hidden_size")
            if moe_ffn is None:
                raise ValueError(f"{self.where}: num_experts={experts} needs moe_ffn_hidden_size (or ffn_hidden_size)")
            shapes["decoder.layers.mlp.router.weight"] = (layers, experts, hidden)
            shapes["decoder.layers.mlp.experts.experts.linear_fc2.weight"] = (layers, experts, hidden, moe_ffn)
            shared = a("moe_shared_expert_intermediate_size")
            if shared:
                shapes["decoder.layers.mlp.shared_experts.linear_fc2.weight"] = (layers, hidden, shared)
        else:
            ffn = a("ffn_hidden_size", default=4 * hidden)
            shapes["decoder.layers.mlp.linear_fc1.weight"] = (layers, 2 * ffn, hidden)
            shapes["decoder.layers.mlp.linear_fc2.weight"] = (layers, hidden, ffn)
        if given["untie_embeddings_and_output_weights"]:
            shapes["output_layer.weight"] = (vocab, hidden)
        if a("qk_layernorm"):
            shapes["decoder.layers.self_attention.q_layernorm.weight"] = (layers, channels)
        if a("add_qkv_bias"):
            shapes["decoder.layers.self_attention.linear_qkv.bias"] = (layers, (heads + 2 * groups) * channels)
        try:
            config, _ = infer_config(shapes.get, given, self.where, self.where)
        except ConversionError as e:
            raise ValueError(str(e)) from None
        return config

    def _passed(self) -> dict[str, Any]:
        """The arguments that are ``TransformerConfig`` fields the model takes as given (not set
        here from the model's arguments, not fixed, not a parallel size)."""
        from megatron.core.transformer import TransformerConfig

        fields = {f.name for f in dataclasses.fields(TransformerConfig)}
        given = {_TC_NAMES.get(k, k): v for k, v in self.args.items()}
        return {k: v for k, v in given.items() if k in fields and k not in _OURS and k not in _MUST_BE_ONE}

    def transformer_config(self) -> Any:
        """MCore's ``TransformerConfig`` of these arguments (EP 1: :func:`mcore.build_gpt` sets it)."""
        from megatron.core.transformer import TransformerConfig

        c = self.config
        kwargs: dict[str, Any] = dict(hidden_dropout=0.0, attention_dropout=0.0)
        kwargs.update(self._passed())
        kwargs.update(
            num_layers=c.num_layers,
            hidden_size=c.hidden_size,
            num_attention_heads=c.num_attention_heads,
            num_query_groups=c.num_query_groups,
            kv_channels=c.kv_channels,
            ffn_hidden_size=c.ffn_hidden_size,
            layernorm_epsilon=c.norm_epsilon,
            qk_layernorm=c.qk_layernorm,
            add_qkv_bias=c.add_qkv_bias,
            normalization="RMSNorm",
            gated_linear_unit=True,
            activation_func=torch.nn.functional.silu,
            bias_activation_fusion=False,
            add_bias_linear=False,
            use_cpu_initialization=True,
            params_dtype=torch.float32,
            pipeline_dtype=torch.float32,
            moe_grouped_gemm=bool(self.args.get("moe_grouped_gemm", False)),
        )
        if c.num_experts:
            kwargs.update(
                num_moe_experts=c.num_experts,
                moe_router_topk=c.moe_router_topk,
                moe_ffn_hidden_size=c.moe_ffn_hidden_size,
                moe_router_pre_softmax=c.moe_router_pre_softmax,
                moe_router_score_function=c.moe_score_func,
                moe_aux_loss_coeff=c.moe_aux_loss_coeff,
            )
            kwargs.setdefault("moe_token_dispatcher_type", "allgather")
            if c.moe_shared_expert_ffn_hidden_size:
                kwargs["moe_shared_expert_intermediate_size"] = c.moe_shared_expert_ffn_hidden_size
        try:
            return TransformerConfig(**kwargs)
        except Exception as e:  # noqa: BLE001 - whatever MCore's checks raise (a KeyError for an unknown scope): one line
            what = one_line(f"{type(e).__name__}: {e}", 200)
            raise ValueError(f"{self.where}: Megatron-Core refuses these arguments: {what}") from None

    # ---- what a checkpoint records ---------------------------------------------------------
    def record(self) -> dict[str, Any]:
        return {"kind": MEGATRON_CORE, "args": self.args, "layer_spec": self.layer_spec, "name": self.name}

    def model_config(self) -> dict[str, Any] | None:
        return self.config.to_dict()

    def min_params(self) -> int:
        return estimate_parameters(self.config.to_dict())

    def describe_differences(self, manifest: dict[str, Any]) -> list[str]:
        record = model_source_of(manifest) or {}
        if not record and not manifest.get("model_config"):
            return []  # the checkpoint names no model (e.g. made from a bare file): the run's flags do
        if record.get("kind") != MEGATRON_CORE:
            return [f"kind={record.get('kind')!r} (this run: {MEGATRON_CORE!r})"]
        out = []
        if record.get("layer_spec", "local") != self.layer_spec:
            out.append(f"layer_spec={record.get('layer_spec')!r} (this run: {self.layer_spec!r})")
        try:
            saved = McoreSource(record.get("args") or {}, "saved").config.to_dict()
        except ValueError:
            saved = {}
        ours = self.config.to_dict()
        out += [
            f"{k}={saved.get(k)!r} (this run: {ours.get(k)!r})"
            for k in sorted(set(saved) | set(ours))
            if saved.get(k) != ours.get(k)
        ]
        return out

    # ---- building and training -------------------------------------------------------------
    def build(self, seed: int, mesh: ExpertMesh | None, micro_batches: int = 1) -> nn.Module:
        model = mcore.build_gpt(
            self.transformer_config(),
            vocab_size=self.config.vocab_size,
            max_sequence_length=self.config.seq_length,
            tied=self.config.tie_embeddings,
            rotary_base=self.config.rotary_base,
            layer_spec=self.layer_spec,
            ep_size=mesh.ep_size if mesh is not None else 1,
            seed=seed,
        )
        lost = mcore.unsaved_state(model)
        if lost:
            raise ValueError(
                f"{self.where}: the model keeps state checkpoints do not carry: {', '.join(lost[:3])}"
                + (f" (+{len(lost) - 3} more)" if len(lost) > 3 else "")
            )
        mcore.set_aux_loss_scale(1.0 / micro_batches)
        return model

    def shard_units(self, model: nn.Module) -> list[nn.Module]:
        return mcore.shard_units(model)

    def placement(self, policy: str, mesh: ExpertMesh | None) -> PlacementFn:
        return mcore.placement(policy, mesh)

    def after_shard(self, model: nn.Module) -> None:
        names = mcore.canonical_names(model)
        rename_params(model, lambda fqn: names.get(fqn, fqn))

    def forward(
        self, model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return mcore.forward(model, tokens)

    def linear_weights(self, model: nn.Module) -> list[nn.Parameter]:
        return mcore.linear_weights(model)

    def n_params(self) -> int:
        with torch.device("meta"):  # the reference model of the same config has the same weights
            return sum(p.numel() for p in GPTModel(self.config).parameters())
