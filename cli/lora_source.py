"""A model with LoRA adapters (``--lora``): a transformers causal LM wrapped by PEFT before it is
sharded.

PEFT (``peft.inject_adapter_in_model``) replaces each targeted ``nn.Linear`` by its LoRA layer, in
place: the original weight moves under ``base_layer`` and is frozen, as is every other weight of
the model; only the adapters (``lora_A``, ``lora_B``) train. Frozen parameters are sharded like the
rest but get no gradient buffer, no reduction and no optimizer state (``fully_shard`` groups
parameters by ``requires_grad``).

Checkpoints name the weights as the model without adapters does (``…q_proj.weight``), and each
adapter after its layer (``…q_proj.lora_A.weight``: PEFT's own names without its ``base_layer``
and adapter-name levels), so that a LoRA checkpoint and the base model's agree on every frozen
weight. The model's ``model_source`` record is the base model's plus ``lora``: a resumed run
rebuilds the same adapters without the flag.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from mfsdp_ckpt.errors import one_line
from mfsdp_ckpt.format.lora import LoraSpec, lora_of_record
from mfsdp_ckpt.format.model_source import model_source_of
from mfsdp_core import rename_params

from .lora import PEFT_HINT
from .model_base import ModelSource

if TYPE_CHECKING:
    import torch
    from torch import nn

    from mfsdp_core.expert_parallel import ExpertMesh
    from mfsdp_core.plan import PlacementFn

    from .hf_source import HFSource

__all__ = ["LoraSource", "checkpoint_name"]

_BASE_LAYER = re.compile(r"\.base_layer(?=\.)")
_ADAPTER = re.compile(r"\.(lora_[AB])\.default(?=\.)")


def checkpoint_name(fqn: str) -> str:
    """The checkpoint name of a parameter of a PEFT LoRA model: ``…q_proj.base_layer.weight`` ->
    ``…q_proj.weight``, ``…q_proj.lora_A.default.weight`` -> ``…q_proj.lora_A.weight``."""
    return _ADAPTER.sub(r".\1", _BASE_LAYER.sub("", fqn))


class LoraSource(ModelSource):
    """``inner`` (a transformers model's source) with the LoRA adapters of ``spec``;
    ``adapter_params``: their parameter count, ``adapter_keys``: their checkpoint keys."""

    def __init__(self, inner: HFSource, spec: LoraSpec, where: str = "--lora") -> None:
        """ValueError naming ``where`` (``--lora``, or the checkpoint whose ``model_source.lora``
        the spec comes from) when PEFT cannot adapt the model so (no module matches the targets,
        or one it does not support) or ``r`` exceeds a targeted layer's smaller dimension: found
        on the model's ``meta`` copy, before any adapter tensor is made."""
        self.inner, self.spec, self.where = inner, spec, where
        self.kind, self.name = inner.kind, inner.name
        self.vocab_size, self.seq_length, self.num_experts = inner.vocab_size, inner.seq_length, inner.num_experts
        meta = self._adapted(inner.meta_model())
        adapters = [(name, p) for name, p in meta.named_parameters() if p.requires_grad]
        self.adapter_params = sum(p.numel() for _, p in adapters)
        self.adapter_keys = frozenset(f"model.{checkpoint_name(name)}" for name, _ in adapters)

    # ---- what a checkpoint records ---------------------------------------------------------
    def record(self) -> dict[str, Any]:
        return {**self.inner.record(), "lora": self.spec.to_record()}

    def extra(self) -> dict[str, Any]:
        return self.inner.extra()

    def resumed(self, extra: dict[str, Any]) -> None:
        self.inner.resumed(extra)

    def describe_differences(self, manifest: dict[str, Any]) -> list[str]:
        out = self.inner.describe_differences(manifest)
        record = model_source_of(manifest) or {}
        try:
            saved: LoraSpec | None = lora_of_record(record, "saved")
        except ValueError:
            saved = None
        if saved != self.spec:
            out.append(f"lora={str(saved) if saved else None!r} (this run: {str(self.spec)!r})")
        return out

    def describe_init_differences(self, manifest: dict[str, Any]) -> list[str]:
        if self.starts_fresh(manifest):  # the base model's checkpoint: its adapters start fresh
            return self.inner.describe_differences(manifest)
        return self.describe_differences(manifest)

    def starts_fresh(self, manifest: dict[str, Any]) -> frozenset[str]:
        record = model_source_of(manifest) or {}
        return self.adapter_keys if record.get("lora") is None else frozenset()

    def min_params(self) -> int | None:
        return self.inner.min_params()

    # ---- building and training -------------------------------------------------------------
    def check_parallel(self, world: int, ep: int) -> None:
        self.inner.check_parallel(world, ep)

    def build(self, seed: int, mesh: ExpertMesh | None, micro_batches: int = 1) -> nn.Module:
        """The inner model, then its adapters (PEFT's initialisation: ``lora_A`` random, seeded
        by ``seed`` again so that the draw does not depend on how the base was built, ``lora_B``
        zero, so the adapted model starts equal to the base)."""
        import torch

        model = self.inner.build(seed, mesh, micro_batches)
        torch.manual_seed(seed)
        return self._adapted(model)

    def _adapted(self, model: nn.Module) -> nn.Module:
        """``model`` with PEFT's LoRA layers in place of the targeted modules (all else frozen).
        Targets must name ``nn.Linear`` modules (the adapters' names and their merge into an
        exported model are a linear layer's)."""
        from torch import nn

        targets, where = self.spec.targets, self.where
        matched = [(n, m) for n, m in model.named_modules() if n.rpartition(".")[2] in targets]
        found = {n.rpartition(".")[2] for n, _ in matched}
        if missing := [t for t in targets if t not in found]:
            raise ValueError(f"{where} targets: {type(model).__name__} has no module named {missing[0]!r}")
        for name, module in matched:
            if not isinstance(module, nn.Linear):
                raise ValueError(
                    f"{where} targets: {name} ({type(module).__name__}) is not an nn.Linear (LoRA adapts linear layers)"
                )
            smaller = min(module.in_features, module.out_features)
            if self.spec.r > smaller:  # checked before PEFT makes any adapter tensor
                raise ValueError(
                    f"{where}: r={self.spec.r} exceeds {name} ({module.in_features} in, {module.out_features} out): "
                    f"the rank is at most a targeted layer's smaller dimension, here {smaller}"
                )
        try:
            import peft
        except ImportError:
            raise ValueError(f"{where}: the peft package is not installed ({PEFT_HINT})") from None
        config = peft.LoraConfig(
            r=self.spec.r,
            lora_alpha=self.spec.alpha,
            target_modules=list(self.spec.targets),
            lora_dropout=self.spec.dropout,
            bias="none",
        )
        try:
            return peft.inject_adapter_in_model(config, model)
        except (ValueError, TypeError, RuntimeError) as e:  # PEFT's: no module matches, or one it cannot adapt
            raise ValueError(f"{where} targets={','.join(self.spec.targets)}: {one_line(e)}") from None

    def shard_units(self, model: nn.Module) -> list[nn.Module]:
        return self.inner.shard_units(model)

    def placement(self, policy: str, mesh: ExpertMesh | None) -> PlacementFn:
        return self.inner.placement(policy, mesh)

    def after_shard(self, model: nn.Module) -> None:
        self.inner.after_shard(model)
        rename_params(model, checkpoint_name)

    def forward(
        self, model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inner.forward(model, tokens, labels)

    def after_step(self, model: nn.Module) -> None:
        self.inner.after_step(model)

    def n_params(self) -> int:
        return self.inner.n_params() + self.adapter_params

    def trainable_note(self) -> str:
        spec = self.spec
        dropout = f", dropout {spec.dropout:g}" if spec.dropout else ""
        return (
            f" ({self.adapter_params:,} trainable: LoRA r={spec.r}, alpha {spec.alpha:g} on "
            f"{', '.join(spec.targets)}{dropout}; the rest frozen)"
        )
