"""One flat buffer: the parameters of one ``fully_shard`` unit that share a dtype and
expert-ness, packed per a :class:`~mfsdp_core.layout.Layout` and sharded per a strategy.

Storage, by strategy (n = shard group size, S = shard size, G = n·S gathered size):

=====================  ==============  ===================  =================
state                  no_shard        optim / optim_grads  optim_grads_params
=====================  ==============  ===================  =================
compute params         gathered (G)    gathered (G)         shard (S); gathered (G) only around forward / backward
main params (fp32)     G               S                    S
reduced grads          G               G / S                S
=====================  ==============  ===================  =================

When the compute dtype equals the main dtype the main params alias the local compute shard, so
fp32 training keeps one copy. A parameter that is contiguous in the gathered buffer is a view of
it; one that straddles the padding between two shards (``row`` / ``block`` layouts) gets its own
"spill" tensor, reassembled after each all-gather.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from . import collectives as C
from .layout import Layout, Piece
from .mixed_precision import MixedPrecision
from .strategy import Strategy

__all__ = ["FlatParamBuffer"]


def _free(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(0)


def _alloc(t: torch.Tensor) -> None:
    nbytes = t.numel() * t.element_size()
    if t.untyped_storage().size() != nbytes:
        t.untyped_storage().resize_(nbytes)


class FlatParamBuffer:
    """Packed, sharded storage for a list of parameters, with its unshard / reshard and
    gradient reduction. Parameters keep their identity: their ``.data`` becomes a view."""

    def __init__(
        self,
        names: list[str],
        params: list[nn.Parameter],
        *,
        strategy: Strategy,
        layout: Layout,
        dp_group: dist.ProcessGroup | None,
        mixed_precision: MixedPrecision,
        is_expert: bool = False,
    ) -> None:
        self.local_names = names
        self.params = params
        self.prefix = ""  # set by fully_shard on the root: canonical name = prefix + local name
        self.strategy = strategy
        self.is_expert = is_expert
        self.dp_group = dp_group
        self.shard_group = dp_group if strategy.shards_optim else None
        self.shard_rank = C.group_rank(self.shard_group)
        if layout.group_size != C.group_size(self.shard_group):
            raise ValueError(f"layout is for {layout.group_size} ranks, the shard group has {C.group_size(self.shard_group)}")
        self.layout = layout
        self.requires_grad = params[0].requires_grad
        orig_dtype = params[0].dtype
        self.compute_dtype = mixed_precision.param_dtype or orig_dtype
        self.main_dtype = mixed_precision.main_dtype if self.requires_grad else self.compute_dtype
        self.reduce_dtype = mixed_precision.reduce_dtype

        S, G, r = self.layout.shard_size, self.layout.gathered_size, self.shard_rank
        self.device = params[0].device
        originals = [p.detach().reshape(-1) for p in params]
        self.gathered = torch.zeros(G, dtype=self.compute_dtype, device=self.device)
        for i, flat in enumerate(originals):
            for pc in self.layout.owners(i):
                self._gathered_slice(pc).copy_(flat[pc.start : pc.end])
        local = self.gathered[r * S : (r + 1) * S]
        self.shard = local.clone() if strategy.shards_params else local
        if self.main_dtype == self.compute_dtype:
            self.main = self.shard
        else:  # filled from the original values, not from their low-precision copy
            self.main = torch.zeros(S, dtype=self.main_dtype, device=self.device)
            for pc in self.layout.local_pieces(r):
                self.main[pc.shard_offset : pc.shard_offset + pc.numel].copy_(originals[pc.param][pc.start : pc.end])
        if self.requires_grad:
            self.grad = torch.zeros(S if strategy.shards_grads else G, dtype=self.reduce_dtype, device=self.device)
            self.local_grad = self.grad if strategy.shards_grads else self.grad[r * S : (r + 1) * S]
        self.spills: dict[int, torch.Tensor] = {}
        for i, off in enumerate(self.layout.gathered_offsets):
            if off is None:
                self.spills[i] = originals[i].to(self.compute_dtype, copy=True)
        for i, p in enumerate(params):
            p.data = self._unsharded_flat(i).view(p.shape)
        del originals
        self.is_unsharded = True
        self.shard_params: list[nn.Parameter] | None = None  # set by the optimizer adapter
        self._staging: torch.Tensor | None = None
        self._pending = 0
        self.reduced_this_pass = False
        self._reset_pass()
        self.reshard()

    # ---- views -------------------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        """Canonical (root-relative) names of the parameters."""
        return [self.prefix + n for n in self.local_names]

    def _gathered_slice(self, pc: Piece, t: torch.Tensor | None = None) -> torch.Tensor:
        base = self.gathered if t is None else t
        pos = pc.rank * self.layout.shard_size + pc.shard_offset
        return base[pos : pos + pc.numel]

    def _unsharded_flat(self, i: int) -> torch.Tensor:
        off = self.layout.gathered_offsets[i]
        if off is None:
            return self.spills[i]
        return self.gathered[off : off + self.layout.numels[i]]

    def local_piece(self, i: int) -> Piece:
        """The part of parameter ``i`` this rank owns (its main param / optimizer state range)."""
        return self.layout.piece(i, self.shard_rank)

    # ---- unshard / reshard ---------------------------------------------------------------
    def unshard(self) -> None:
        """Gather the full compute parameters (ZeRO-3 only; otherwise they are always there)."""
        if self.is_unsharded:
            return
        _alloc(self.gathered)
        for t in self.spills.values():
            _alloc(t)
        C.all_gather(self.gathered, self.shard, self.shard_group)
        self._fill_spills()
        self.is_unsharded = True

    def reshard(self) -> None:
        """Free the full compute parameters (ZeRO-3 only)."""
        if not (self.strategy.shards_params and self.is_unsharded):
            return
        _free(self.gathered)
        for t in self.spills.values():
            _free(t)
        self.is_unsharded = False

    def _fill_spills(self) -> None:
        for i, spill in self.spills.items():
            for pc in self.layout.owners(i):
                spill[pc.start : pc.end].copy_(self._gathered_slice(pc))

    @torch.no_grad()
    def refresh_compute_params(self) -> None:
        """Copy the main params into the compute params (cast) and make every rank's full
        compute params current: after an optimizer step, or after a checkpoint load."""
        if self.main is not self.shard:
            self.shard.copy_(self.main)
        if self.strategy.shards_params:
            if self.is_unsharded:
                C.all_gather(self.gathered, self.shard, self.shard_group)
                self._fill_spills()
        elif self.layout.group_size > 1:
            C.all_gather(self.gathered, self.shard, self.shard_group)
            self._fill_spills()
        else:
            self._fill_spills()

    # ---- gradients -----------------------------------------------------------------------
    def _reset_pass(self) -> None:
        self._pending = sum(1 for p in self.params if p.requires_grad)
        self.reduced_this_pass = False

    @torch.no_grad()
    def on_grad_ready(self, i: int) -> None:
        """Called once parameter ``i``'s gradient for this backward pass is accumulated: move it
        into the staging buffer, drop it, and reduce once the whole buffer is ready."""
        self._stage(i)
        self._pending -= 1
        if self._pending == 0:
            self.finish_backward()

    def _stage(self, i: int) -> None:
        """Move parameter ``i``'s ``.grad`` into the staging buffer (gathered layout)."""
        p = self.params[i]
        if self._staging is None:
            self._staging = torch.zeros(self.layout.gathered_size, dtype=self.reduce_dtype, device=self.device)
        flat = p.grad.reshape(-1)
        for pc in self.layout.owners(i):
            self._gathered_slice(pc, self._staging).copy_(flat[pc.start : pc.end])
        p.grad = None

    @torch.no_grad()
    def finish_backward(self) -> None:
        """Reduce this pass's gradients into the accumulated grads and, for ZeRO-3, reshard.
        Parameters that got no gradient contribute zeros."""
        if self.requires_grad and not self.reduced_this_pass:
            for i, p in enumerate(self.params):  # a gradient that reached .grad without the hook
                if p.grad is not None:
                    self._stage(i)
            staging = self._staging
            if staging is None:  # no parameter got a gradient: reduce zeros, as the other ranks may not
                staging = torch.zeros(self.layout.gathered_size, dtype=self.reduce_dtype, device=self.device)
            self._restart_accumulation_if_zeroed()
            if self.strategy.shards_grads:
                reduced = torch.empty(self.layout.shard_size, dtype=self.reduce_dtype, device=self.device)
                C.reduce_scatter_avg(reduced, staging, self.shard_group)
                self.grad.add_(reduced)
            else:
                C.all_reduce_avg(staging, self.dp_group)
                self.grad.add_(staging)
            self._staging = None
            self.reduced_this_pass = True
        self.reshard()

    def _restart_accumulation_if_zeroed(self) -> None:
        """``optimizer.zero_grad()`` (set_to_none) unlinks the shard params' grads: then the
        accumulated gradient starts again from zero, as PyTorch's own semantics say."""
        if self.shard_params is None:
            return
        if any(sp is not None and sp.grad is None for sp in self.shard_params):
            self.grad.zero_()
            self.link_shard_grads()

    def link_shard_grads(self) -> None:
        """Point each optimizer shard parameter's ``.grad`` at its slice of the reduced grads."""
        for i, sp in enumerate(self.shard_params or ()):
            if sp is None:
                continue  # a parameter the optimizer does not own
            pc = self.local_piece(i)
            sp.grad = self.local_grad[pc.shard_offset : pc.shard_offset + pc.numel]

    def end_pass(self) -> None:
        self._reset_pass()
