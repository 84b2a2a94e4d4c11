"""What the trainer needs of a model family: the interface each model source implements.

The trainer (``cli.trainer``) is one loop for every family: it builds the model a source describes,
shards the units the source names with the source's placement, runs ``forward`` for logits and the
auxiliary loss, and saves the source's record in every checkpoint's manifest, from which the same
source is rebuilt on ``--resume``. The families: the reference GPT (``cli.model_source``),
Hugging Face ``transformers`` models (``cli.hf_source``) and Megatron-Core ``GPTModel``
(``cli.mcore_source``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mfsdp_core.expert_layout import check_expert_parallel

if TYPE_CHECKING:  # describing a model (the launcher's pre-flight) imports no torch; building one does
    import torch
    from torch import nn

    from mfsdp_core.expert_parallel import ExpertMesh
    from mfsdp_core.plan import PlacementFn

__all__ = ["ModelSource"]


class ModelSource:
    """One model the trainer can build, described by what rebuilds it. Subclasses set the
    attributes in their constructor and implement the methods marked so."""

    kind: str  # mfsdp_ckpt.format.model_source kind: "mfsdp-gpt", "transformers" or "megatron-core"
    name: str  # shown in the run header and saved as ``extra.model``
    vocab_size: int
    seq_length: int | None  # the longest --seq-len it takes; None: no limit
    num_experts: int  # 0 for a dense model

    # ---- what a checkpoint records ---------------------------------------------------------
    def record(self) -> dict[str, Any]:
        """The manifest's ``model_source``: the kind and what rebuilds the model."""
        raise NotImplementedError

    def model_config(self) -> dict[str, Any] | None:
        """A ``GPTConfig.to_dict()`` when one describes the weights under our canonical names (the
        reference GPT; Megatron-Core, whose keys are renamed to ours), else None."""
        return None

    def extra(self) -> dict[str, Any]:
        """Entries saved as ``extra.<name>`` with every checkpoint (plain values and tensors)."""
        return {}

    def resumed(self, extra: dict[str, Any]) -> None:
        """Take what the source keeps in ``extra`` back from the checkpoint a run resumes from
        (its ``extra.*`` values), so that the run's next checkpoints carry it again."""

    def describe_differences(self, manifest: dict[str, Any]) -> list[str]:
        """Why the model a checkpoint's manifest records is not this one (``field=saved (this run:
        ours)`` each); empty when it is the same model."""
        raise NotImplementedError

    def describe_init_differences(self, manifest: dict[str, Any]) -> list[str]:
        """:meth:`describe_differences` for a run that takes only the weights of the checkpoint
        (``--init-from``), where :meth:`starts_fresh`'s keys may be absent from it."""
        return self.describe_differences(manifest)

    def starts_fresh(self, manifest: dict[str, Any]) -> frozenset[str]:
        """The model keys (``model.<name>``) a run started from the weights of the checkpoint of
        ``manifest`` does not find there and keeps as initialised: none, but a LoRA run's
        adapters started from a checkpoint without them."""
        return frozenset()

    def min_params(self) -> int | None:
        """A lower bound of the model's parameter count from its config alone (None: the family
        has none), compared with the tensors a checkpoint holds before the model is built."""
        return None

    @classmethod
    def from_record(cls, record: dict[str, Any], where: str) -> "ModelSource":
        """The source a manifest's record describes; ValueError naming ``where`` if it cannot be."""
        raise NotImplementedError

    # ---- building and training -------------------------------------------------------------
    def check_parallel(self, world: int, ep: int) -> None:
        """ValueError naming the numbers unless ``ep`` ranks can share the experts over ``world``."""
        check_expert_parallel(world, ep, self.num_experts)

    def build(self, seed: int, mesh: ExpertMesh | None, micro_batches: int = 1) -> nn.Module:
        """The whole model on this rank, seeded by ``seed`` (``--seed``), expert parallelism applied
        when ``mesh`` is given, on the CPU, not yet sharded; ``micro_batches`` (``--micro-batches``)
        for a family whose auxiliary losses are scaled inside the model (Megatron-Core)."""
        raise NotImplementedError

    def shard_units(self, model: nn.Module) -> list[nn.Module]:
        """The modules to ``fully_shard``, inner first, the root last."""
        raise NotImplementedError

    def placement(self, policy: str, mesh: ExpertMesh | None) -> PlacementFn:
        """Every parameter's placement: experts over the expert-data-parallel group under EP."""
        from mfsdp_core.expert_parallel import expert_placement
        from mfsdp_core.plan import placement_fn

        return placement_fn(None, policy) if mesh is None else expert_placement(policy)

    def after_shard(self, model: nn.Module) -> None:
        """Anything due once the root is sharded (e.g. checkpoint names: ``rename_params``)."""

    def forward(
        self, model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(fp32 logits [b, s, vocab], scalar auxiliary loss)`` of ``tokens [b, s]`` whose next
        tokens are ``labels [b, s]`` (a family with multi-token prediction uses them)."""
        raise NotImplementedError

    def after_step(self, model: nn.Module) -> None:
        """Anything due after each optimizer step (e.g. moving the routers' expert biases)."""

    def use_global_aux_loss(self, model: nn.Module) -> None:
        """Count the load-balancing loss over every rank's tokens (``--moe-aux-loss global``);
        ValueError where the family has no such loss of ours."""
        raise ValueError(f"--moe-aux-loss global: only the reference GPT's MoE layers have it, not {self.kind} models")

    def linear_weights(self, model: nn.Module) -> list[nn.Parameter]:
        """The transformer layers' linear weights, which ``--mxfp8`` stores as MXFP8 (empty: the
        family does not support it)."""
        return []

    def n_params(self) -> int:
        """The whole model's parameter count (whichever experts this rank holds)."""
        raise NotImplementedError

    def trainable_note(self) -> str:
        """What of the model trains, for the run header, when not all of it does (e.g. LoRA
        adapters); empty when every parameter trains."""
        return ""
