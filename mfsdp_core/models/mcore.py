"""Runtime support for genuine Megatron-Core (MCore) ``GPTModel`` s under ``fully_shard``: the one
place that makes MCore run here (:func:`prepare_cpu`, :func:`init_parallel_state`), a builder
whose weights do not depend on the EP size (:func:`build_gpt`), the shard units, the placement
of MCore's expert parameters, the names checkpoints give MCore's parameters, and one forward.

Only tensor / pipeline parallel size 1: the ranks are data parallel, and with EP > 1 also expert
parallel (MCore's own ``parallel_state`` groups, checked to be laid out as
:func:`mfsdp_core.expert_parallel.init_expert_mesh` lays them out). ``megatron`` is imported
lazily, inside the functions that need it: it is an optional dependency.

**Checkpoint names.** MCore's module tree names some weights otherwise than its own checkpoints
do (``sharded_state_dict_keys_map`` of the local layer spec), and numbers experts by their index
on this rank. :func:`canonical_names` gives every parameter the name MCore's checkpoints give it,
per layer and per *global* expert, which is also our reference ``GPTModel``'s name; so a
checkpoint of a trained MCore model reads exactly like an ``import-mcore`` output:

=====================================================================  =========================================================
MCore module fqn (``L`` the layer, ``i`` the local expert)              checkpoint name
=====================================================================  =========================================================
``decoder.layers.L.input_layernorm.weight`` (local spec)               ``decoder.layers.L.self_attention.linear_qkv.layer_norm_weight``
``decoder.layers.L.pre_mlp_layernorm.weight`` (dense layer)            ``decoder.layers.L.mlp.linear_fc1.layer_norm_weight``
``decoder.layers.L.pre_mlp_layernorm.weight`` (MoE layer)              kept (the Transformer Engine spec's name)
``decoder.layers.L.mlp.experts.local_experts.i.linear_fc1.weight``     ``decoder.layers.L.mlp.experts.linear_fc1.weight<e>``
``decoder.layers.L.mlp.experts.linear_fc1.weight<i>`` (TE grouped)     ``decoder.layers.L.mlp.experts.linear_fc1.weight<e>``
everything else                                                        kept
=====================================================================  =========================================================

with ``e = local_expert_indices[i]`` of the layer (``ep_rank · E_local + i``). MCore's local spec
maps the MoE pre-MLP norm to ``mlp.linear_fc1.layer_norm_weight``; Transformer Engine's spec and
our checkpoints call it ``pre_mlp_layernorm.weight`` (``export-mcore --moe-norm local`` writes the
local name). The legacy ``GroupedMLP`` (``experts.weight1`` / ``weight2``, all local experts in one
tensor) has no per-expert name and is refused.

**State beyond parameters.** MCore's local spec keeps no buffers; its linear layers add
``_extra_state`` entries to ``state_dict()`` that are ``None`` (Transformer Engine keeps FP8
metadata there). Checkpoints carry parameters; :func:`unsaved_state` names any entry that would be
lost (a buffer, a non-empty ``_extra_state``) so that a caller can refuse such a model.
"""

from __future__ import annotations

import dataclasses
import io
import re
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mfsdp_core.expert_parallel import ExpertMesh, expert_placement
from mfsdp_core.plan import Placement, PlacementFn, placement_fn

__all__ = [
    "prepare_cpu",
    "init_parallel_state",
    "build_gpt",
    "shard_units",
    "placement",
    "canonical_names",
    "expert_param",
    "linear_weights",
    "forward",
    "unsaved_state",
    "set_aux_loss_scale",
]

_LAYER = re.compile(r"^(decoder\.layers\.\d+\.)(.*)$")
_LOCAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")  # SequentialMLP
_GROUPED_EXPERT = re.compile(r"^mlp\.experts\.(linear_fc[12]\.(?:weight|bias))(\d+)$")  # TEGroupedMLP
_LEGACY_GROUPED = re.compile(r"^mlp\.experts\.weight[12]$")  # GroupedMLP: every local expert in one tensor


def prepare_cpu() -> None:
    """Everything megatron-core 0.16 needs to run without a GPU, in one place (idempotent; does
    nothing to torch where CUDA is available):

    - ``torch.cuda.current_device()`` returns the CPU device: MCore creates RoPE frequencies,
      attention masks and router tensors on ``torch.cuda.current_device()``;
    - ``torch.cuda.synchronize()`` does nothing (the ``torch_dist`` checkpoint writer calls it);
    - ``moe_utils.te_general_gemm = None`` without Transformer Engine: 0.16.1's router names it
      unconditionally, and defines it only when TE imports.

    What is not patched but chosen by the builders: ``use_cpu_initialization``, the ``allgather``
    token dispatcher (the ``alltoall`` one makes a CUDA stream), no grouped GEMM, and the RNG
    tracker of :func:`init_parallel_state`."""
    if not torch.cuda.is_available():
        torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
        torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    import megatron.core.transformer.moe.moe_utils as moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def init_parallel_state(ep_size: int, seed: int) -> None:
    """(Re)initialise MCore's ``parallel_state`` for TP = PP = 1 and EP = ``ep_size`` over the
    whole world (collective; a one-rank gloo group is started when torch.distributed is not), and
    seed MCore's RNG tracker (on CPU the inference tracker, which never reads CUDA RNG state).
    Raises ValueError unless MCore's EP groups are ours: ``ep_size`` consecutive ranks (EP
    fastest), and its expert-data-parallel groups the ranks ``p, p + E, …``."""
    from megatron.core import parallel_state, tensor_parallel

    prepare_cpu()
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, expert_model_parallel_size=ep_size
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=not torch.cuda.is_available())
    rank, world = dist.get_rank(), dist.get_world_size()
    first = ep_size * (rank // ep_size)
    want = {
        "expert-parallel": list(range(first, first + ep_size)),
        "expert-data-parallel": list(range(rank % ep_size, world, ep_size)),
    }
    got = {
        "expert-parallel": dist.get_process_group_ranks(parallel_state.get_expert_model_parallel_group()),
        "expert-data-parallel": dist.get_process_group_ranks(parallel_state.get_expert_data_parallel_group()),
    }
    for name in want:
        if sorted(got[name]) != want[name]:
            raise ValueError(
                f"Megatron-Core's {name} group of rank {rank} is {got[name]}, ours is {want[name]} "
                f"(EP {ep_size}, world {world}): the rank orders differ"
            )


def build_gpt(
    config: Any,
    *,
    vocab_size: int,
    max_sequence_length: int,
    tied: bool,
    rotary_base: float,
    layer_spec: str,
    ep_size: int,
    seed: int,
) -> nn.Module:
    """MCore's ``GPTModel`` for the ``TransformerConfig`` ``config`` (its
    ``expert_model_parallel_size`` is set to ``ep_size``), RoPE positions, on this rank, seeded by
    ``seed``; ``layer_spec``: ``local`` (MCore's own modules) or ``transformer_engine``.

    The weights equal those of the one-rank model built from the same seed, whatever ``ep_size``:
    MCore draws each rank's local experts from the RNG stream in order, so with EP > 1 the whole
    model is first built at EP 1 (from ``seed``), then the EP model, into which every parameter
    is copied by its checkpoint name (experts by global index); the EP-1 model is then dropped
    (it costs one whole model's memory for a moment). Leaves ``parallel_state`` at EP ``ep_size``."""
    from megatron.core.models.gpt import GPTModel

    num_experts = getattr(config, "num_moe_experts", None) or None

    def make(ep: int) -> nn.Module:
        init_parallel_state(ep, seed)
        torch.manual_seed(seed)
        cfg = dataclasses.replace(config, expert_model_parallel_size=ep)
        return GPTModel(
            cfg,
            _layer_spec(layer_spec, num_experts, cfg),
            vocab_size=vocab_size,
            max_sequence_length=max_sequence_length,
            share_embeddings_and_output_weights=tied,
            position_embedding_type="rope",
            rotary_base=rotary_base,
        )

    if ep_size == 1:
        return make(1)
    whole = make(1)
    reference = {
        canonical: p for (name, p), canonical in zip(whole.named_parameters(), canonical_names(whole).values())
    }
    model = make(ep_size)
    with torch.no_grad():
        for name, canonical in canonical_names(model).items():
            model.get_parameter(name).copy_(reference[canonical])
    del whole, reference
    return model


def _layer_spec(name: str, num_experts: int | None, config: Any) -> Any:
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if name == "local":
        return specs.get_gpt_layer_local_spec(
            num_experts=num_experts,
            moe_grouped_gemm=False,
            qk_layernorm=config.qk_layernorm,
            normalization=config.normalization,
        )
    if name == "transformer_engine":
        return specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=config.moe_grouped_gemm, qk_layernorm=config.qk_layernorm
        )
    raise ValueError(f"layer spec {name!r}: expected 'local' or 'transformer_engine'")


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The modules to ``fully_shard``, inner first: every ``TransformerLayer``
    (``model.decoder.layers``), then the root (embedding, final norm, output layer)."""
    return [*model.decoder.layers, model]


def expert_param(name: str) -> int | None:
    """The local expert index of an MCore routed-expert parameter (``name`` relative to the model
    or to its layer): ``…mlp.experts.local_experts.<i>.linear_fc1.weight`` or the TE grouped
    ``…mlp.experts.linear_fc1.weight<i>``; None for any other parameter (shared experts and the
    router are not routed experts). ValueError for the legacy ``GroupedMLP`` weights."""
    m = _LAYER.match(name)
    rest = m.group(2) if m else name
    if (e := _LOCAL_EXPERT.match(rest)) is not None:
        return int(e.group(1))
    if (e := _GROUPED_EXPERT.match(rest)) is not None:
        return int(e.group(2))
    if _LEGACY_GROUPED.match(rest):
        raise ValueError(
            f"parameter '{name}': the legacy GroupedMLP holds all local experts in one tensor, which has no "
            "per-expert checkpoint name; use moe_grouped_gemm=False (or the TE grouped GEMM)"
        )
    return None


def placement(policy: str, mesh: ExpertMesh | None) -> PlacementFn:
    """Where each parameter goes. Without expert parallelism: ``policy`` over ``"dp"``, experts in
    buffers of their own (``fully_shard``'s default). With a mesh: MCore's routed experts
    (:func:`expert_param`) over the expert-data-parallel group ``"edp"`` (the ranks holding the
    same experts), their summed gradients divided by the ``"dp"`` size, as
    :func:`mfsdp_core.expert_parallel.expert_placement` does for ours (MCore's allgather dispatcher
    sends each expert the tokens of its whole EP group, so the sum over ``edp`` covers every rank's
    tokens); everything else, router and shared experts included, over ``"dp"``."""
    if mesh is None or mesh.ep_size == 1:
        base = placement_fn(None, policy)

        def local(name: str, param: nn.Parameter) -> Placement:
            expert_param(name)  # refuses the legacy GroupedMLP
            return base(name, param)

        return local
    return expert_placement(policy, lambda name: expert_param(name) is not None)


def canonical_names(model: nn.Module) -> dict[str, str]:
    """``{module fqn: checkpoint name}`` for every parameter of an MCore ``GPTModel`` (see the
    module docstring), in ``named_parameters()`` order. ValueError when two would coincide."""
    moe_layers = {
        f"decoder.layers.{i}.": getattr(layer.mlp, "local_expert_indices", None)
        for i, layer in enumerate(model.decoder.layers)
    }
    out: dict[str, str] = {}
    for name, _ in model.named_parameters():
        new = name
        m = _LAYER.match(name)
        if m is not None:
            prefix, rest = m.groups()
            experts = moe_layers.get(prefix)
            if rest.startswith("input_layernorm."):
                new = prefix + "self_attention.linear_qkv.layer_norm_" + rest[len("input_layernorm.") :]
            elif rest.startswith("pre_mlp_layernorm.") and experts is None:
                new = prefix + "mlp.linear_fc1.layer_norm_" + rest[len("pre_mlp_layernorm.") :]
            elif (e := _LOCAL_EXPERT.match(rest)) is not None:
                new = f"{prefix}mlp.experts.{e.group(2)}{experts[int(e.group(1))]}"
            elif (e := _GROUPED_EXPERT.match(rest)) is not None:
                new = f"{prefix}mlp.experts.{e.group(1)}{experts[int(e.group(2))]}"
            else:
                expert_param(name)  # refuses the legacy GroupedMLP
        out[name] = new
    seen: dict[str, str] = {}
    for old, new in out.items():
        if new in seen:
            raise ValueError(f"parameters '{seen[new]}' and '{old}' would both be named '{new}'")
        seen[new] = old
    return out


def linear_weights(model: nn.Module) -> list[nn.Parameter]:
    """The 2-D weights of the transformer layers' linear projections (QKV, output projection,
    dense MLP, experts, shared experts): what ``--mxfp8`` stores as MXFP8. Not the routers (one
    row per expert), norms, embedding or output layer."""
    return [
        p
        for layer in model.decoder.layers
        for name, p in layer.named_parameters()
        if p.ndim == 2 and not name.endswith("router.weight")
    ]


def set_aux_loss_scale(scale: float) -> None:
    """The factor MCore's MoE load-balancing loss gradient is given in backward (MCore injects it
    itself, through ``MoEAuxLossAutoScaler``; Megatron-LM's schedule sets ``1 / micro-batches``)."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    MoEAuxLossAutoScaler.main_loss_backward_scale = torch.tensor(float(scale))


def forward(model: nn.Module, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``tokens [b, s]`` -> (fp32 logits ``[b, s, V]``, a zero aux loss): positions ``0 … s-1``
    and an explicit causal mask. MCore adds its MoE aux-loss gradient inside backward
    (:func:`set_aux_loss_scale`), so nothing is returned for the caller to add."""
    b, s = tokens.shape
    positions = torch.arange(s, device=tokens.device).unsqueeze(0).expand(b, s)
    masked = torch.triu(torch.ones(s, s, dtype=torch.bool, device=tokens.device), diagonal=1)[None, None]
    logits = model(tokens, positions, masked)
    return logits.float(), torch.zeros((), device=logits.device)


def _empty_extra_state(value: Any) -> bool:
    if value is None:
        return True
    if isinstance(value, torch.Tensor):
        return value.numel() == 0
    if isinstance(value, io.BytesIO):
        return len(value.getbuffer()) == 0
    return False


def unsaved_state(model: nn.Module) -> list[str]:
    """The ``state_dict()`` entries of ``model`` that are neither parameters nor empty
    ``_extra_state`` (buffers, FP8 metadata): what a checkpoint of its parameters would lose."""
    params = {name for name, _ in model.named_parameters()}
    out = []
    for key, value in model.state_dict(keep_vars=True).items():
        if key in params:
            continue
        if key.endswith("._extra_state") and _empty_extra_state(value):
            continue
        out.append(key)
    return out
