"""The reference model's MoE layer: router, routed SwiGLU experts (one parameter per expert, under
its global index), an optional shared expert (optionally gated), and two load-balancing
mechanisms: the auxiliary loss, on this rank's tokens or on the whole data-parallel batch
(:func:`set_aux_loss_group`), and DeepSeek-V3's expert bias, moved after every step by the
tokens each expert got over all ranks (:func:`update_expert_bias`)."""

from __future__ import annotations

from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mfsdp_core import collectives as C
from mfsdp_core.expert_parallel import ExpertMesh
from mfsdp_core.fully_shard import owner_of
from mfsdp_core.models.config import GPTConfig
from mfsdp_core.models.layers import Linear, param, swiglu
from mfsdp_core.token_dispatch import dispatch_and_run

__all__ = [
    "Router",
    "ExpertWeights",
    "Experts",
    "SharedExpertMLP",
    "MoELayer",
    "moe_layers",
    "set_aux_loss_group",
    "update_expert_bias",
]


class SharedExpertMLP(nn.Module):
    """SwiGLU MLP without a fused norm (its input is already ``pre_mlp_layernorm``-ed); with
    ``gate``, its output is scaled per token by ``sigmoid(x @ gate_weight.T)`` (Megatron-Core's
    ``moe_shared_expert_gate``, Qwen3-Next's ``shared_expert_gate``)."""

    def __init__(self, hidden: int, ffn: int, gate: bool = False) -> None:
        super().__init__()
        self.linear_fc1 = Linear(hidden, 2 * ffn)
        self.linear_fc2 = Linear(ffn, hidden)
        self.gate_weight = param(1, hidden) if gate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear_fc2(swiglu(self.linear_fc1(x)))
        if self.gate_weight is not None:
            out = out * torch.sigmoid(F.linear(x, self.gate_weight))
        return out


class ExpertWeights(nn.Module):
    """Holds one weight per expert as parameters ``weight0``, ``weight1``, … (MCore
    ``TEGroupedLinear`` naming, global expert index). Under expert parallelism only the experts
    ``local`` of this rank remain, still under their global index."""

    def __init__(self, num_experts: int, out_features: int, in_features: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.local = range(num_experts)
        for e in range(num_experts):
            self.register_parameter(f"weight{e}", param(out_features, in_features))

    def __getitem__(self, e: int) -> torch.Tensor:
        return getattr(self, f"weight{e}")

    def keep_only(self, local: range) -> None:
        """Drop every expert's weight but those of ``local`` (global indices)."""
        for e in range(self.num_experts):
            if e not in local:
                delattr(self, f"weight{e}")
        self.local = local


class Experts(nn.Module):
    """The routed SwiGLU experts: ``linear_fc1.weight{e}`` ``[2 * moe_ffn, hidden]`` and
    ``linear_fc2.weight{e}`` ``[hidden, moe_ffn]``."""

    def __init__(self, num_experts: int, hidden: int, ffn: int) -> None:
        super().__init__()
        self.linear_fc1 = ExpertWeights(num_experts, 2 * ffn, hidden)
        self.linear_fc2 = ExpertWeights(num_experts, hidden, ffn)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``e`` on ``x [n, hidden]``; ``n`` may be 0."""
        return F.linear(swiglu(F.linear(x, self.linear_fc1[e])), self.linear_fc2[e])


class Router(nn.Module):
    """Linear router, ``weight [num_experts, hidden]``; logits are computed in fp32. With
    ``expert_bias``, a non-trained parameter ``expert_bias [num_experts]`` (MCore's name; HF's
    ``e_score_correction_bias``), zero at first: it is a parameter with ``requires_grad=False`` so
    that it is sharded, checkpointed, resharded and exported with the weights."""

    def __init__(self, num_experts: int, hidden: int, expert_bias: bool = False) -> None:
        super().__init__()
        self.weight = param(num_experts, hidden)
        self.expert_bias = param(num_experts, init="zeros") if expert_bias else None
        if self.expert_bias is not None:
            self.expert_bias.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight.float())


class MoELayer(nn.Module):
    """Top-k routed SwiGLU experts plus an optional shared expert, on already-normed input.

    Routing, per token, from the fp32 router logits:
      * scores: ``softmax`` over all experts, or element-wise ``sigmoid``;
      * choice: the top-k of the scores (plus ``expert_bias`` when enabled, which changes which
        experts are chosen, never their weights); with groups, only among the
        ``moe_router_group_topk`` groups whose top ``topk // group_topk`` scores sum highest;
      * weights: the chosen scores; softmax ones renormalised to sum to 1 unless
        ``moe_router_pre_softmax``; sigmoid ones renormalised when k > 1; then times
        ``moe_router_topk_scaling_factor``.
    The output is ``sum_k weight_k * expert_k(x)`` (+ the shared expert, optionally gated).

    Load-balancing loss (Switch-style, as MCore's ``aux_loss``): with N tokens,
    ``f_e = (#assignments to e) / (N * k)`` and ``P_e = mean over tokens of the full score
    distribution`` (softmax probabilities; for sigmoid the scores normalised per token),
    ``aux = moe_aux_loss_coeff * E * sum_e f_e * P_e``. By default both are over this rank's
    tokens. With an aux-loss group (:func:`set_aux_loss_group`) ``f_e`` counts the tokens of the
    whole group (one small all-reduce), so that the ranks' losses average to the loss of one
    process on the whole batch, and so do their gradients. It is stored in ``self.aux_loss``
    on every forward, with ``self.tokens_per_expert``.

    Every expert runs on every forward, on its possibly empty token subset: an empty matmul still
    connects the expert's weights to the graph, so they receive a (zero) gradient, which a sharded
    runtime needs on every rank.

    Under expert parallelism (:meth:`use_expert_parallel`) this rank holds only its experts; routing,
    aux loss and ``tokens_per_expert`` stay computed on this rank's tokens, exactly as above, and
    the routed tokens travel to their experts' ranks and back (:mod:`mfsdp_core.token_dispatch`).
    ``tokens_received`` then counts, per local expert, the rows it processed from the whole EP
    group.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        c = config
        self.num_experts, self.topk = c.num_experts, c.moe_router_topk
        self.score_func, self.aux_loss_coeff = c.moe_score_func, c.moe_aux_loss_coeff
        self.pre_softmax = c.moe_router_pre_softmax
        self.num_groups, self.group_topk = c.moe_router_num_groups, c.moe_router_group_topk
        self.scaling = c.moe_router_topk_scaling_factor
        self.bias_update_rate = c.moe_router_bias_update_rate
        self.router = Router(c.num_experts, c.hidden_size, c.moe_router_enable_expert_bias)
        self.experts = Experts(c.num_experts, c.hidden_size, c.moe_ffn_hidden_size)
        if c.moe_shared_expert_ffn_hidden_size > 0:
            self.shared_experts = SharedExpertMLP(
                c.hidden_size, c.moe_shared_expert_ffn_hidden_size, gate=c.moe_shared_expert_gate
            )
        else:
            self.shared_experts = None
        self.aux_loss: torch.Tensor | None = None
        self.tokens_per_expert: torch.Tensor | None = None
        self.tokens_received: torch.Tensor | None = None
        self.tokens_since_update: torch.Tensor | None = None  # summed over forwards, for the expert bias
        self.aux_loss_group: Any = None  # None: the aux loss counts this rank's tokens only
        self.ep_group = None
        self.ep_rank = 0
        self.ep_size = 1

    def use_expert_parallel(self, mesh: ExpertMesh) -> None:
        """Keep only this rank's experts (``mesh.local_experts``) and dispatch tokens over its EP
        group. Call before ``fully_shard``."""
        if self.num_experts % mesh.ep_size:
            raise ValueError(f"EP size {mesh.ep_size} does not divide the number of experts {self.num_experts}")
        for weights in (self.experts.linear_fc1, self.experts.linear_fc2):
            weights.keep_only(mesh.local_experts(self.num_experts))
        self.ep_group, self.ep_rank, self.ep_size = mesh.ep_group, mesh.ep_rank, mesh.ep_size

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [n, hidden]`` -> (top-k weights ``[n, k]`` fp32, top-k expert indices ``[n, k]``,
        full per-token distribution ``[n, E]`` fp32 used by the aux loss)."""
        logits = self.router(x)
        if self.score_func == "softmax":
            scores = torch.softmax(logits, dim=-1)
            dist_ = scores
        else:
            scores = torch.sigmoid(logits)
            dist_ = scores / scores.sum(dim=-1, keepdim=True)
        choice = scores if self.router.expert_bias is None else scores + self.router.expert_bias.float()
        if self.num_groups:
            choice = self._keep_best_groups(choice)
        top_idx = torch.topk(choice, self.topk, dim=-1).indices
        top_w = scores.gather(1, top_idx)
        if self.score_func == "softmax":
            if not self.pre_softmax:
                top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        elif self.topk > 1:
            top_w = top_w / (top_w.sum(dim=-1, keepdim=True) + 1e-20)
        if self.scaling != 1.0:
            top_w = top_w * self.scaling
        return top_w, top_idx, dist_

    def _keep_best_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """``choice`` with -inf outside each token's ``group_topk`` best groups (a group's score:
        the sum of its top ``topk // group_topk`` choice scores)."""
        n = choice.shape[0]
        grouped = choice.view(n, self.num_groups, -1)
        group_scores = grouped.topk(self.topk // self.group_topk, dim=-1).values.sum(dim=-1)
        best = torch.topk(group_scores, self.group_topk, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(n, -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        n = x.shape[0]
        top_w, top_idx, dist_ = self.route(x)

        if self.ep_size > 1:
            sent = dispatch_and_run(x, top_idx, self.num_experts, self.ep_group, self.ep_rank, self.experts.expert)
            weights = top_w[sent.token, sent.slot].unsqueeze(-1).to(sent.outputs.dtype)
            out = torch.zeros_like(x).index_add(0, sent.token, sent.outputs * weights)
            self.tokens_received = sent.received.sum(0)
        else:
            out = torch.zeros_like(x)
            for e in range(self.num_experts):
                token, slot = torch.where(top_idx == e)  # tokens in order; possibly empty
                y = self.experts.expert(e, x[token])
                out = out.index_add(0, token, y * top_w[token, slot].unsqueeze(-1).to(y.dtype))
            self.tokens_received = torch.bincount(top_idx.flatten(), minlength=self.num_experts)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)

        counts = torch.bincount(top_idx.flatten(), minlength=self.num_experts)
        self.aux_loss = self._aux_loss(counts, n, dist_)
        self.tokens_per_expert = counts.detach()
        if torch.is_grad_enabled() and self.router.expert_bias is not None:
            total = self.tokens_since_update
            self.tokens_since_update = self.tokens_per_expert if total is None else total + self.tokens_per_expert
        return out.view(shape)

    def _aux_loss(self, counts: torch.Tensor, n: int, dist_: torch.Tensor) -> torch.Tensor:
        if self.aux_loss_coeff == 0:
            return dist_.new_zeros(())
        assigned = counts.float()
        tokens = torch.tensor([float(n)], device=counts.device)
        if self.aux_loss_group is not None:  # the whole batch's counts: one all-reduce of E + 1 numbers
            both = torch.cat([assigned, tokens])
            C.all_reduce_sum(both, self.aux_loss_group)
            assigned, tokens = both[:-1], both[-1:]
        f = assigned / (tokens * self.topk)
        return self.aux_loss_coeff * self.num_experts * (f * dist_.mean(dim=0)).sum()


def moe_layers(model: nn.Module) -> Iterator[MoELayer]:
    """Every MoE layer of ``model`` (decoder and MTP layers), in module order."""
    return (m for m in model.modules() if isinstance(m, MoELayer))


def set_aux_loss_group(model: nn.Module, group: dist.ProcessGroup | None) -> nn.Module:
    """Count the load-balancing loss's token fractions over ``group`` (every rank whose tokens
    make the batch: the data-parallel group, experts included), or over this rank's tokens only
    (None, the default). Returns ``model``."""
    for layer in moe_layers(model):
        layer.aux_loss_group = group
    return model


@torch.no_grad()
def update_expert_bias(model: nn.Module, group: dist.ProcessGroup | None) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing, after an optimizer step: each MoE layer's
    expert bias moves by ``moe_router_bias_update_rate * sign(mean load - load of e)``, the loads
    being the tokens routed to each expert since the last update, summed over ``group`` (every
    rank, so that every rank applies the same update). Works on a sharded model (the bias is a
    frozen parameter: each rank updates the range it owns) and on a plain one."""
    layers = [layer for layer in moe_layers(model) if layer.router.expert_bias is not None]
    if not layers:
        return
    loads = torch.stack(
        [
            layer.tokens_since_update.float()
            if layer.tokens_since_update is not None
            else torch.zeros(layer.num_experts, device=layer.router.weight.device)
            for layer in layers
        ]
    )
    C.all_reduce_sum(loads, group)
    touched = {}
    for layer, load in zip(layers, loads):
        delta = layer.bias_update_rate * torch.sign(load.mean() - load)
        bias = layer.router.expert_bias
        owner = owner_of(bias)
        if owner is None:
            bias.add_(delta.to(bias.dtype))
        else:
            buf, i = owner
            pc = buf.local_piece(i)
            buf.main[pc.shard_offset : pc.shard_offset + pc.numel].add_(delta[pc.start : pc.end].to(buf.main.dtype))
            touched[id(buf)] = buf
        layer.tokens_since_update = None
    for buf in touched.values():
        buf.refresh_compute_params()
