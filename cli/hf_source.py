"""The trainer's Hugging Face family (``--hf-model DIR``): a genuine ``transformers`` causal LM
trained under our ``fully_shard``.

``DIR`` is a model directory with a ``config.json``, with or without weights. The class is the
config's ``architectures[0]`` (a ``…ForCausalLM`` of transformers), else the causal LM transformers
maps the ``model_type`` to. Without weights the model starts from transformers' own
initialisation, seeded by ``--seed``; with safetensors weights (``model.safetensors``, or shards
and their index) they are checked against the model the config builds (every tensor present, of
the shape the config makes it) before anything else happens, then loaded bitwise.

Checkpoints name the tensors as the model's ``named_parameters()`` does (tied embeddings once) and
record the class and ``config.json`` (``model_source``, kind ``transformers``), so ``--resume``
needs no ``--hf-model``; the directory's ``generation_config.json`` and tokenizer files travel in
every checkpoint (``extra.hf_files``) and come out again with ``export-hf``.

Units are the decoder layers and the root. Experts: transformers 5 fuses each MoE layer's
experts into 3-D parameters (``mlp.experts.gate_up_proj``), which are sharded over all ranks like
any parameter; ``--ep`` is refused (our expert parallelism places whole per-expert parameters).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from mfsdp_ckpt.errors import ConversionError, one_line
from mfsdp_ckpt.format.model_source import TRANSFORMERS, model_source_of
from mfsdp_ckpt.hf.config_check import (
    check_hf_config,
    check_hf_model_dir,
    check_model_fits,
    estimated_params,
    safetensors_bytes,
    without_remote_code,
)
from mfsdp_ckpt.hf.expert_families import EXPERT_FIELDS, fused_experts_refusal
from mfsdp_ckpt.hf.files import HFDirectory
from mfsdp_ckpt.hf.transformers_layout import (
    DiskTensor,
    carried_files,
    check_weights,
    disk_layout,
    has_weights,
    is_fused_expert,
    load_weights,
)
from mfsdp_core.expert_parallel import ExpertMesh, check_expert_parallel
from mfsdp_core.models import hf
from mfsdp_core.plan import PlacementFn

from .model_base import ModelSource

__all__ = ["HFSource", "INSTALL_HINT"]

INSTALL_HINT = "pip install 'mfsdp-ckpt[hf]'"
#: config.json fields that say nothing about the model's math (ignored when comparing records)
_VOLATILE = {
    "transformers_version",
    "dtype",
    "torch_dtype",
    "_name_or_path",
    "architectures",
    "use_cache",
    "_attn_implementation_autoset",
    "auto_map",  # never honoured (an older record may hold them; this run's never does)
    "trust_remote_code",
}
#: the key under which a checkpoint carries the directory's other files
FILES_EXTRA = "hf_files"


def _transformers(where: str) -> Any:
    try:
        import transformers
    except ImportError:
        raise ValueError(f"{where}: transformers is not installed ({INSTALL_HINT})") from None
    return transformers


def _config_of(d: dict[str, Any], where: str) -> Any:
    """transformers' config object of the ``config.json`` dict ``d``."""
    transformers = _transformers(where)
    model_type = d.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise ValueError(f"{where}: no model_type field (a transformers config.json names its architecture there)")
    try:
        config_class = transformers.CONFIG_MAPPING[model_type]
    except KeyError:
        raise ValueError(
            f"{where}: model_type {model_type!r} is not an architecture transformers {transformers.__version__} knows"
        ) from None
    try:
        return config_class.from_dict(dict(d))
    except Exception as e:  # noqa: BLE001 - transformers' own checks of hostile values raise anything
        raise ValueError(
            f"{where}: transformers cannot build a {model_type} config from it: {one_line(e) or type(e).__name__}"
        ) from None


def _class_of(config: Any, d: dict[str, Any], where: str) -> type[nn.Module]:
    """The causal-LM class: ``architectures[0]`` if it names one of transformers', else the
    ``model_type``'s ``AutoModelForCausalLM`` class."""
    transformers = _transformers(where)
    archs = d.get("architectures")
    if isinstance(archs, list) and archs:
        name = archs[0]
        cls = getattr(transformers, name, None) if isinstance(name, str) else None
        if cls is None:
            raise ValueError(
                f"{where}: architectures[0] {name!r} is not a class of transformers {transformers.__version__}"
            )
        if not name.endswith("ForCausalLM"):
            raise ValueError(f"{where}: architectures[0] {name!r} is not a causal LM (a …ForCausalLM class)")
        return cls
    try:
        return transformers.MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        raise ValueError(
            f"{where}: model_type {d.get('model_type')!r} has no causal-LM class in transformers"
        ) from None


class HFSource(ModelSource):
    """A transformers causal LM of the ``config.json`` dict ``config`` (read from ``where``, named
    in errors); ``weights``: the model directory whose safetensors to load (checked here), or None;
    ``files``: the directory's carried files (name -> bytes).

    The config passes :func:`~mfsdp_ckpt.hf.config_check.check_hf_config` before transformers
    sees it, and the model it describes (with transformers' defaults filled in) must fit this
    machine's memory and the weights present (:func:`~mfsdp_ckpt.hf.config_check.check_model_fits`)
    before anything is built, even on ``meta``. ``auto_map`` / ``trust_remote_code`` are dropped:
    the class is always transformers' own, and checkpoints never record them."""

    kind = TRANSFORMERS

    def __init__(
        self,
        config: dict[str, Any],
        where: str,
        name: str,
        weights: str | None = None,
        files: dict[str, bytes] | None = None,
    ) -> None:
        self.where, self.name, self.weights = where, name, weights
        config = without_remote_code(config)
        try:
            check_hf_config(config, where)
            self.hf_config = _config_of(config, where)
            weights_bytes = safetensors_bytes(weights) if weights is not None else None
            check_model_fits(self.hf_config.to_dict(), where, weights_bytes=weights_bytes)
        except ConversionError as e:
            raise ValueError(str(e)) from None
        self.cls = _class_of(self.hf_config, config, where)
        self.config_dict = {**config, "architectures": [self.cls.__name__]}
        self.model_type = self.hf_config.model_type
        self._carry(files or {})
        try:
            with torch.device("meta"):
                meta = self._new_model()
        except Exception as e:  # noqa: BLE001 - a config transformers accepted may still not build
            raise ValueError(
                f"{where}: transformers cannot build {self.cls.__name__} from it: {one_line(e) or type(e).__name__}"
            ) from None
        try:
            hf.decoder_layers(meta)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        self.shapes = {n: tuple(p.shape) for n, p in meta.named_parameters()}
        self.fused = [n for n, s in self.shapes.items() if is_fused_expert(n, s)]
        try:
            self.layout: dict[str, list[DiskTensor]] = disk_layout(self.model_type, self.shapes, where)
        except ConversionError as e:
            raise ValueError(str(e)) from None
        self.vocab_size = int(self.hf_config.vocab_size)
        self.seq_length = getattr(self.hf_config, "max_position_embeddings", None)
        self.num_experts = int(next((n for k in EXPERT_FIELDS if (n := getattr(self.hf_config, k, None))), 0))
        if weights is not None:
            self._check_weights()

    def _new_model(self) -> nn.Module:
        return self.cls(self.hf_config)

    def meta_model(self) -> nn.Module:
        """The model on the ``meta`` device: its structure, no storage."""
        with torch.device("meta"):
            return self._new_model()

    # ---- construction ----------------------------------------------------------------------
    @classmethod
    def from_dir(cls, path: str) -> "HFSource":
        """The source of ``--hf-model path``: ValueError, one line naming the file and field at
        fault, for a directory that is not an HF model, an architecture transformers does not
        know, or weights that disagree with the config."""
        try:
            d = check_hf_model_dir(path)  # the launcher's torch-free check, first: the same rules
        except ConversionError as e:
            raise ValueError(str(e)) from None
        config_path = os.path.join(path, "config.json")
        if not has_weights(path) and any(n.endswith((".bin", ".pt", ".pth")) for n in os.listdir(path)):
            raise ValueError(
                f"{path}: its weights are pickle files (.bin/.pt); only safetensors weights are read "
                "(convert them with transformers' save_pretrained)"
            )
        try:
            files = carried_files(path)
        except ConversionError as e:
            raise ValueError(str(e)) from None
        name = os.path.basename(os.path.normpath(path)) or "hf-model"
        return cls(d, config_path, name, weights=path if has_weights(path) else None, files=files)

    @classmethod
    def from_record(cls, record: dict[str, Any], where: str) -> "HFSource":
        config = record.get("config")
        if not isinstance(config, dict):
            raise ValueError(f"{where}: model_source.config is not a JSON object (a transformers config.json)")
        return cls(config, f"{where}: model_source.config", str(record.get("name") or "hf-model"))

    def _check_weights(self) -> None:
        tied = bool(getattr(self.hf_config, "tie_word_embeddings", False))
        try:
            with HFDirectory(self.weights) as directory:
                check_weights(
                    directory,
                    self.layout,
                    self.config_dict,
                    ignorable=lambda n: (tied and n == "lm_head.weight") or n.endswith("rotary_emb.inv_freq"),
                )
        except ConversionError as e:
            raise ValueError(str(e)) from None

    def min_params(self) -> int:
        return estimated_params(self.hf_config.to_dict())

    # ---- what a checkpoint records ---------------------------------------------------------
    def record(self) -> dict[str, Any]:
        return {
            "kind": TRANSFORMERS,
            "class": self.cls.__name__,
            "config": self.config_dict,
            "name": self.name,
            "files": sorted(self.files),
        }

    def _carry(self, files: dict[str, bytes]) -> None:
        """Keep the carried files as the byte tensors every checkpoint stores (made once, not per save)."""
        self.files: dict[str, torch.Tensor] = {
            n: torch.frombuffer(bytearray(b), dtype=torch.uint8) if b else torch.zeros(0, dtype=torch.uint8)
            for n, b in files.items()
        }

    def extra(self) -> dict[str, Any]:
        return {FILES_EXTRA: self.files} if self.files else {}

    def resumed(self, extra: dict[str, Any]) -> None:
        files = extra.get(FILES_EXTRA)
        if isinstance(files, dict):
            self.files = {str(n): t for n, t in files.items() if isinstance(t, torch.Tensor) and t.dtype == torch.uint8}

    def describe_differences(self, manifest: dict[str, Any]) -> list[str]:
        record = model_source_of(manifest) or {}
        if not record and not manifest.get("model_config"):
            return []  # the checkpoint names no model (e.g. made from a bare file): the run's flags do
        if record.get("kind") != TRANSFORMERS:
            return [f"kind={record.get('kind')!r} (this run: {TRANSFORMERS!r})"]
        out = []
        if record.get("class") != self.cls.__name__:
            out.append(f"class={record.get('class')!r} (this run: {self.cls.__name__!r})")
        recorded = record.get("config") if isinstance(record.get("config"), dict) else {}
        try:
            check_hf_config(recorded, "saved")  # hostile values never reach transformers
            saved = _config_of(recorded, "saved").to_dict()
        except (ValueError, ConversionError):
            saved = dict(recorded)
        ours = self.hf_config.to_dict()
        keys = sorted((set(saved) | set(ours)) - _VOLATILE)
        out += [f"{k}={saved.get(k)!r} (this run: {ours.get(k)!r})" for k in keys if saved.get(k) != ours.get(k)]
        return out

    # ---- building and training -------------------------------------------------------------
    def check_parallel(self, world: int, ep: int) -> None:
        if ep > 1 and self.fused:
            raise ValueError(fused_experts_refusal(self.cls.__name__))
        check_expert_parallel(world, ep, self.num_experts)

    def build(self, seed: int, mesh: ExpertMesh | None, micro_batches: int = 1) -> nn.Module:
        torch.manual_seed(seed)
        model = self._new_model()
        if any(p.dtype != torch.float32 for p in model.parameters()):
            model = model.float()  # main weights are fp32; --dtype bf16 computes in bf16
        if self.weights is not None:
            params = dict(model.named_parameters())
            with torch.no_grad(), HFDirectory(self.weights) as directory:
                load_weights(directory, self.layout, {n: p.data for n, p in params.items()})
        model.train()
        return model

    def shard_units(self, model: nn.Module) -> list[nn.Module]:
        return hf.shard_units(model)

    def placement(self, policy: str, mesh: ExpertMesh | None) -> PlacementFn:
        return hf.placement(policy)

    def forward(
        self, model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return hf.causal_lm_forward(model, tokens)

    def linear_weights(self, model: nn.Module) -> list[nn.Parameter]:
        return hf.linear_weights(model)

    def n_params(self) -> int:
        return sum(torch.Size(s).numel() for s in self.shapes.values())
