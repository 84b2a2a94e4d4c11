"""One flat buffer: the parameters of one ``fully_shard`` unit that share a placement, dtype and
``requires_grad``, packed per their :class:`~mfsdp_core.plan.BufferSpec` and sharded per its
strategy over the placement's group.

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
"spill" tensor, reassembled after each all-gather. Companion planes (see
:class:`~mfsdp_core.plan.Companion`) are stored, derived and gathered the same way, next to the
compute params.

An MXFP8 buffer (``placement.mx``) gathers its MX planes instead of its weights: the rowwise
planes to unshard for forward, the columnwise ones for backward, and fills the gathered compute
params by dequantizing them (:mod:`mfsdp_core.mx_planes`). Its compute shard, which never
travels, holds the main params cast to the compute dtype, and never aliases them.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
import torch.distributed as dist
from torch import nn

from mfsdp_core import collectives as C
from mfsdp_core.comm_stream import CommStream
from mfsdp_core.fence import Fence, await_fences
from mfsdp_core.layout import Layout, Piece
from mfsdp_core.mx import dequantize
from mfsdp_core.mx_planes import ORIENTATIONS
from mfsdp_core.plan import BufferSpec
from mfsdp_core.pool import ScratchPool

__all__ = ["FlatParamBuffer"]


class _Plane:
    """One gathered plane: this rank's shard, the gathered buffer (every rank's shard in rank
    order) and a spill tensor for each item that is not contiguous there."""

    def __init__(self, layout: Layout, dtype: torch.dtype, device: torch.device, rank: int, own_shard: bool) -> None:
        self.layout = layout
        S = layout.shard_size
        self.gathered = torch.zeros(layout.gathered_size, dtype=dtype, device=device)
        self.spills = {
            i: torch.zeros(layout.numels[i], dtype=dtype, device=device)
            for i, off in enumerate(layout.gathered_offsets)
            if off is None
        }
        local = self.gathered[rank * S : (rank + 1) * S]
        self.shard = torch.zeros_like(local) if own_shard else local

    def slot(self, pc: Piece, t: torch.Tensor | None = None) -> torch.Tensor:
        """Where piece ``pc`` lies in the gathered layout of ``t`` (default: this plane)."""
        base = self.gathered if t is None else t
        pos = pc.rank * self.layout.shard_size + pc.shard_offset
        return base[pos : pos + pc.numel]

    def full(self, i: int) -> torch.Tensor:
        """Item ``i`` whole (1-D): a view of the gathered buffer, or its spill."""
        off = self.layout.gathered_offsets[i]
        if off is None:
            return self.spills[i]
        return self.gathered[off : off + self.layout.numels[i]]

    def fill(self, i: int, flat: torch.Tensor) -> None:
        """Write item ``i`` whole into every rank's slot (and its spill)."""
        off = self.layout.gathered_offsets[i]
        if off is not None:  # contiguous in the gathered buffer: one copy
            self.gathered[off : off + self.layout.numels[i]].copy_(flat)
            return
        for pc in self.layout.owners(i):
            self.slot(pc).copy_(flat[pc.start : pc.end])
        if i in self.spills:
            self.spills[i].copy_(flat)

    def gather(self, group: dist.ProcessGroup | None) -> None:
        C.all_gather(self.gathered, self.shard, group)
        self.fill_spills()

    def start_gather(self, group: dist.ProcessGroup | None, label: str, comm: CommStream | None = None) -> C.Pending:
        """Issue the all-gather; its ``wait()`` also reassembles the spills (and, with a
        communication stream, hands what it wrote to the compute stream first)."""
        work = C.all_gather(self.gathered, self.shard, group, async_op=True, label=label)
        if comm is None:
            return C.Pending(work, self.fill_spills)

        def to_compute() -> None:
            comm.read_on_compute(self.gathered, *self.spills.values())
            self.fill_spills()

        return C.Pending(work, to_compute)

    def fill_spills(self) -> None:
        for i, spill in self.spills.items():
            for pc in self.layout.owners(i):
                spill[pc.start : pc.end].copy_(self.slot(pc))

    def alloc(self, pool: ScratchPool) -> None:
        for t in (self.gathered, *self.spills.values()):
            pool.supply(t)

    def free(self, pool: ScratchPool) -> None:
        for t in (self.gathered, *self.spills.values()):
            pool.reclaim(t)


class FlatParamBuffer:
    """Packed, sharded storage for a list of parameters, with its unshard / reshard and
    gradient reduction. Parameters keep their identity: their ``.data`` becomes a view."""

    def __init__(
        self,
        spec: BufferSpec,
        params: list[nn.Parameter],
        *,
        group: dist.ProcessGroup | None,
        model_group: dist.ProcessGroup | None,
        replicate_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.spec = spec
        self.params = params
        self.fence: Fence | None = None  # held while a background reader copies this buffer's state (mfsdp_core.fence)
        self.strategy = spec.strategy
        self.group = group  # the placement's group: gradients are reduced over it
        self.shard_group = group if spec.strategy.shards_optim else None
        self.model_group = model_group  # the model's data-parallel group: norms are summed over it
        self.shard_rank = C.group_rank(self.shard_group)
        # HSDP: the group this buffer is replicated across (None: no replicas)
        self.replicate_group = replicate_group
        self.replicate_rank = C.group_rank(replicate_group)
        if spec.group_size != C.group_size(group):
            raise ValueError(
                f"the plan is for {spec.group_size} ranks in group '{spec.placement.group}', "
                f"the process group has {C.group_size(group)}"
            )
        if spec.replicate_size != C.group_size(replicate_group):
            raise ValueError(
                f"the plan is for {spec.replicate_size} replicas over group '{spec.placement.replicate}', "
                f"the process group has {C.group_size(replicate_group)}"
            )
        self.layout = spec.layout
        # who owns which main params / optimizer state / reduced grads: the layout, or under HFSDP
        # its refinement over the replicas (this rank: shard_rank * replicas + replicate_rank)
        self.optim_layout = spec.optim_layout
        self.across_replicas = spec.shards_optim_across_replicas
        self.optim_rank = (
            self.shard_rank * spec.replicate_size + self.replicate_rank if self.across_replicas else self.shard_rank
        )
        self.requires_grad = spec.requires_grad
        self.compute_dtype = spec.compute_dtype
        self.main_dtype = spec.storage_main_dtype
        self.reduce_dtype = spec.main_dtype
        self.device = params[0].device

        S, r = self.layout.shard_size, self.shard_rank
        self.mx = spec.placement.mx
        self.orientation = "row"  # of an MX buffer's gathered compute params: "row" (forward) or "col"
        originals = [p.detach().reshape(-1) for p in params]
        # the compute shard is storage of its own (not a view of the gathered params) under ZeRO-3,
        # and for MX, whose gathered params are dequantized planes, not the weights
        self.own_compute_shard = spec.strategy.shards_params or self.mx is not None
        self.plane = _Plane(self.layout, self.compute_dtype, self.device, r, own_shard=self.own_compute_shard)
        for i, flat in enumerate(originals):
            self.plane.fill(i, flat)
        if self.own_compute_shard:
            self.plane.shard.copy_(self.plane.gathered[r * S : (r + 1) * S])
        if self.main_dtype == self.compute_dtype and self.mx is None and not self.across_replicas:
            self.main = self.shard
        else:  # filled from the original values, not from their low-precision copy
            self.main = torch.zeros(self.optim_layout.shard_size, dtype=self.main_dtype, device=self.device)
            for pc in self.optim_layout.local_pieces(self.optim_rank):
                self.main[pc.shard_offset : pc.shard_offset + pc.numel].copy_(originals[pc.param][pc.start : pc.end])
        self.companions = {
            c.name: (
                c,
                _Plane(spec.companion_layouts[c.name], c.dtype, self.device, r, own_shard=spec.strategy.shards_params),
            )
            for c in spec.placement.companions
        }
        if self.requires_grad:
            self.grad = torch.zeros(
                self.optim_layout.shard_size if spec.strategy.shards_grads else self.layout.gathered_size,
                dtype=self.reduce_dtype,
                device=self.device,
            )
            self.local_grad = self.grad if spec.strategy.shards_grads else self.grad[r * S : (r + 1) * S]
        for i, p in enumerate(params):
            p.data = self.plane.full(i).view(p.shape)
        del originals
        self.is_unsharded = True
        # issued all-gathers (a prefetch) whose results are not read yet; an MX buffer fills its
        # compute params from the planes of ``_fill_orientation`` once they have arrived
        self._gathers: list[C.Pending] = []
        self._fill_orientation: str | None = None
        self.pool = ScratchPool()  # the reductions' scratch tensors; fully_shard gives every buffer its root's
        self.comm: CommStream | None = None  # the root's communication stream, if it has one (set_comm_stream)
        self._optim_params: dict[int, "weakref.ref[nn.Parameter]"] = {}
        self._staging: torch.Tensor | None = None
        self._staged: set[int] = set()  # parameters whose gradient is in the staging buffer
        # on CPU / gloo the reduce-scatter sends the gradients from where autograd left them
        # (mfsdp_core.p2p), so they are kept (``_grads``: parameter index -> flat gradient)
        # instead of copied into a staging buffer
        self.reduces_parts = spec.strategy.shards_grads and C.reduces_from_parts(self.plane.shard, self.shard_group)
        self._grads: dict[int, torch.Tensor] = {}
        self._pending = 0
        self.reduced_this_pass = False
        self._reset_pass()
        self._derive_companions()
        for _, plane in self.companions.values():
            plane.gather(self.shard_group)
        if self.mx is not None:
            self._fill_from_mx("row")
        self.reshard()

    # ---- views -------------------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        """Canonical (root-relative) names of the parameters."""
        return self.spec.fqns

    @property
    def label(self) -> str:
        """How this buffer names itself in communication records: its first parameter."""
        return self.spec.fqns[0] if self.spec.fqns else ""

    @property
    def is_expert(self) -> bool:
        return self.spec.is_expert

    @property
    def shard(self) -> torch.Tensor:
        """This rank's shard of the compute params."""
        return self.plane.shard

    @property
    def gathered(self) -> torch.Tensor:
        return self.plane.gathered

    @property
    def spills(self) -> dict[int, torch.Tensor]:
        return self.plane.spills

    def unsharded(self, i: int) -> torch.Tensor:
        """Parameter ``i``'s whole compute weights (1-D; valid while unsharded)."""
        return self.plane.full(i)

    def companion(self, i: int, name: str) -> torch.Tensor:
        """Parameter ``i``'s whole companion plane ``name``, shaped (valid while unsharded)."""
        comp, plane = self.companions[name]
        return plane.full(i).view(comp.shape(self.layout.shapes[i]))

    def companion_shard(self, i: int, name: str) -> tuple[int, int, torch.Tensor]:
        """This rank's owned range ``(start, end, tensor)`` of parameter ``i``'s plane ``name``."""
        _, plane = self.companions[name]
        pc = plane.layout.piece(i, self.shard_rank)
        return pc.start, pc.end, plane.shard[pc.shard_offset : pc.shard_offset + pc.numel]

    def local_piece(self, i: int) -> Piece:
        """The part of parameter ``i`` this rank owns (its main param / optimizer state range)."""
        return self.optim_layout.piece(i, self.optim_rank)

    def owned(self, storage: torch.Tensor, i: int) -> torch.Tensor:
        """The owned range of parameter ``i`` in ``storage`` (main params, reduced grads), shaped
        as the plan shows it to the optimizer (see ``BufferSpec.owned_shape``)."""
        pc = self.local_piece(i)
        return storage[pc.shard_offset : pc.shard_offset + pc.numel].view(self.spec.owned_shape(i, self.optim_rank))

    # ---- unshard / reshard ---------------------------------------------------------------
    def unshard(self, *, backward: bool = False, async_op: bool = False) -> None:
        """Gather the full compute parameters (ZeRO-3 only; otherwise they are always there). An
        MX buffer gathers the planes of the orientation the pass needs (``backward``: columnwise)
        and dequantizes them into the compute params, also when those are always there.

        ``async_op``: only issue the all-gathers (a prefetch); the next plain ``unshard`` (or
        :meth:`wait_unshard`) waits for them before anything reads the parameters."""
        if self.mx is not None:
            self._unshard_mx("col" if backward else "row", async_op)
            return
        if not self.is_unsharded:
            with self._issuing(prefetch=async_op):
                for plane in self._planes():
                    plane.alloc(self.pool)
                    self._gathers.append(plane.start_gather(self.shard_group, self.label, self.comm))
            self.is_unsharded = True
        if not async_op:
            self.wait_unshard()

    def _issuing(self, *, prefetch: bool) -> contextlib.AbstractContextManager:
        """Where collectives are issued from: the communication stream if the root has one."""
        return contextlib.nullcontext() if self.comm is None else self.comm.issue(prefetch=prefetch)

    @property
    def gather_in_flight(self) -> bool:
        """Whether an issued all-gather of this buffer has not been waited for."""
        return bool(self._gathers) or self._fill_orientation is not None

    def wait_unshard(self) -> None:
        """Wait for the all-gathers in flight (a prefetch) and finish them: spills reassembled,
        an MX buffer's compute params dequantized from the arrived planes."""
        gathers, self._gathers = self._gathers, []
        for pending in gathers:
            pending.wait()
        if self._fill_orientation is not None:
            orientation, self._fill_orientation = self._fill_orientation, None
            self._fill_from_mx(orientation)

    def _unshard_mx(self, orientation: str, async_op: bool = False) -> None:
        coming = self._fill_orientation or self.orientation  # what the compute params will hold
        if not (self.is_unsharded and coming == orientation):
            self.wait_unshard()  # the other orientation's planes may still be in flight
            if self.strategy.shards_params:  # else every plane is gathered after each step
                self.plane.alloc(self.pool)  # written by the dequantize, on the compute stream
                with self._issuing(prefetch=async_op):
                    for name in ORIENTATIONS[orientation]:
                        plane = self.companions[name][1]
                        plane.alloc(self.pool)
                        self._gathers.append(plane.start_gather(self.shard_group, self.label, self.comm))
            self._fill_orientation = orientation
            self.is_unsharded = True
        if not async_op:
            self.wait_unshard()

    def _fill_from_mx(self, orientation: str) -> None:
        """The gathered compute params := the weights the ``orientation`` planes stand for."""
        data_name, scale_name = ORIENTATIONS[orientation]
        for i in range(len(self.params)):
            weight = dequantize(self.companion(i, data_name), self.companion(i, scale_name), orientation)
            self.plane.fill(i, weight.to(self.compute_dtype).reshape(-1))
        self.orientation = orientation

    def reshard(self) -> None:
        """Free the full compute parameters (ZeRO-3 only), after any all-gather in flight into them."""
        if not (self.strategy.shards_params and self.is_unsharded):
            return
        self.wait_unshard()
        for plane in self._planes():
            plane.free(self.pool)
        self.is_unsharded = False

    def _planes(self) -> list[_Plane]:
        return [self.plane, *(plane for _, plane in self.companions.values())]

    def _derive_companions(self) -> None:
        """Each rank computes its companion rows from the main values of the rows it owns."""
        for comp, plane in self.companions.values():
            if comp.derive is None:
                continue
            for pc in self.layout.local_pieces(self.shard_rank):
                shape = self.layout.shapes[pc.param]
                cols = shape[1:].numel() if len(shape) else 1
                rows = self.main[pc.shard_offset : pc.shard_offset + pc.numel].view(-1, cols)
                cpc = plane.layout.piece(pc.param, self.shard_rank)
                plane.shard[cpc.shard_offset : cpc.shard_offset + cpc.numel].copy_(
                    comp.derive(rows.float()).reshape(-1)
                )

    @torch.no_grad()
    def refresh_compute_params(self, *, derive_companions: bool = True) -> None:
        """Copy the main params into the compute params (cast), derive the companion planes
        (unless told they were written already), and make every rank's full compute params
        current: after an optimizer step, or after a checkpoint load. Waits for a fence first."""
        await_fences((self,))
        self.wait_unshard()
        if self.across_replicas:
            self._shard_from_replicas()
        elif self.main is not self.shard:
            self.shard.copy_(self.main)
        if derive_companions:
            self._derive_companions()
        if self.mx is not None:
            self._refresh_mx()
            return
        for plane in self._planes():
            if self.strategy.shards_params:
                if self.is_unsharded:  # else the next unshard gathers them
                    plane.gather(self.shard_group)
            elif self.layout.group_size > 1:
                plane.gather(self.shard_group)
            else:  # the shard is a view of the gathered buffer already
                plane.fill_spills()

    def _replica_parts(self) -> list[tuple[int, int]]:
        """HFSDP: ``(offset, length)`` in this rank's compute shard of each replica's part of it."""
        R, s = self.spec.replicate_size, self.shard_rank
        lo, bounds = self.layout.bounds[s], self.optim_layout.bounds
        return [(bounds[s * R + k] - lo, bounds[s * R + k + 1] - bounds[s * R + k]) for k in range(R)]

    def _shard_from_replicas(self) -> None:
        """HFSDP: the compute shard := every replica's main params of it (cast), one all-gather
        across the replicas."""
        R, c = self.spec.replicate_size, self.optim_layout.shard_size
        mine = self.main.to(self.compute_dtype)
        parts = torch.empty(R * c, dtype=self.compute_dtype, device=self.device)
        C.all_gather(parts, mine, self.replicate_group)
        for k, (offset, length) in enumerate(self._replica_parts()):
            self.shard[offset : offset + length].copy_(parts[k * c : k * c + length])

    def _reduce_across_replicas(self, reduced: torch.Tensor, divisor: int) -> torch.Tensor:
        """The shard-group-reduced gradients ``reduced`` summed across the replicas and divided by
        ``divisor``: in place (HSDP), or the part this rank owns (HFSDP: a reduce-scatter)."""
        if not self.across_replicas:
            C.all_reduce_avg(reduced, self.replicate_group, divisor)
            return reduced
        R, c = self.spec.replicate_size, self.optim_layout.shard_size
        parts = torch.zeros(R * c, dtype=reduced.dtype, device=self.device)
        for k, (offset, length) in enumerate(self._replica_parts()):
            parts[k * c : k * c + length].copy_(reduced[offset : offset + length])
        out = torch.empty(c, dtype=reduced.dtype, device=self.device)
        C.reduce_scatter_avg(out, parts, self.replicate_group, divisor)
        return out

    def _refresh_mx(self) -> None:
        """After new main params: every gathered plane current, and the compute params with them."""
        if self.strategy.shards_params:
            if self.is_unsharded:  # else the next unshard gathers the planes it needs
                self.is_unsharded = False
                self._unshard_mx(self.orientation)
            return
        for _, plane in self.companions.values():
            if self.layout.group_size > 1:
                plane.gather(self.shard_group)
            else:
                plane.fill_spills()
        self._fill_from_mx(self.orientation)

    # ---- gradients -----------------------------------------------------------------------
    def _reset_pass(self) -> None:
        self._pending = sum(1 for p in self.params if p.requires_grad)
        self.reduced_this_pass = False

    @torch.no_grad()
    def on_grad_ready(self, i: int) -> bool:
        """Called once parameter ``i``'s gradient for this backward pass is accumulated: move it
        into the staging buffer and drop it. Returns whether the whole buffer is ready (then the
        caller reduces it: :meth:`finish_backward`)."""
        self._stage(i)
        self._pending -= 1
        return self._pending == 0

    def _stage(self, i: int) -> None:
        """Take parameter ``i``'s ``.grad`` for this pass's reduction: kept as it is where the
        reduction sends it from there (``reduces_parts``), else moved into the staging buffer
        (gathered layout)."""
        p = self.params[i]
        if self.reduces_parts:
            self._grads[i] = p.grad.reshape(-1).to(self.reduce_dtype)
            p.grad = None
            return
        if self._staging is None:
            # every element is written before the reduction reads it: the padding here, each
            # parameter's slots by its gradient, or by zeros if none comes (``_staged_gradients``)
            self._staging = self.pool.take(self.layout.gathered_size, self.reduce_dtype, self.device)
            for a, b in self.layout.padding_ranges:
                self._staging[a:b].zero_()
            self._staged = set()
        flat = p.grad.reshape(-1)
        for pc in self.layout.owners(i):
            self.plane.slot(pc, self._staging).copy_(flat[pc.start : pc.end])
        self._staged.add(i)
        p.grad = None

    def _staged_gradients(self) -> torch.Tensor:
        """This pass's staging buffer, complete: zeros where a parameter got no gradient."""
        if self._staging is None:  # no parameter got a gradient: reduce zeros, as the other ranks may not
            return self.pool.take(self.layout.gathered_size, self.reduce_dtype, self.device, zero=True)
        staging, self._staging = self._staging, None
        for i in range(len(self.params)):
            if i not in self._staged:
                for pc in self.layout.owners(i):
                    self.plane.slot(pc, staging).zero_()
        return staging

    def _gradient_parts(self) -> list[torch.Tensor | int]:
        """This pass's gradients as the consecutive parts of the gathered layout: each rank's
        pieces in shard order, then its padding (a count of zeros); a parameter that got no
        gradient contributes zeros."""
        grads, self._grads = self._grads, {}
        parts: list[torch.Tensor | int] = []
        for pieces in self.layout.pieces_by_rank:
            used = 0
            for pc in pieces:
                grad = grads.get(pc.param)
                if grad is None:
                    grad = grads[pc.param] = torch.zeros(
                        self.layout.numels[pc.param], dtype=self.reduce_dtype, device=self.device
                    )
                parts.append(grad[pc.start : pc.end])
                used += pc.numel
            if self.layout.shard_size > used:
                parts.append(self.layout.shard_size - used)
        return parts

    @torch.no_grad()
    def finish_backward(self, *, async_op: bool = False) -> C.Pending | None:
        """Reduce this pass's gradients into the accumulated grads and, for ZeRO-3, reshard.
        Parameters that got no gradient contribute zeros. Gradients are summed over the
        placement's group in rank order and divided by the plan's divisor.

        ``async_op``: return with the reduction in flight (the parameters are resharded at once:
        backward is done with them); the handle's ``wait()`` completes it (the sum, the step
        across replicas, the accumulation into the grads). None when there was nothing to
        reduce. Handles must be waited for in the order they were returned, the same on every
        rank (the completion may issue collectives of its own)."""
        pending = None
        if self.requires_grad and not self.reduced_this_pass:
            for i, p in enumerate(self.params):  # a gradient that reached .grad without the hook
                if p.grad is not None:
                    self._stage(i)
            staging = None if self.reduces_parts else self._staged_gradients()
            self.reduced_this_pass = True
            divisor = self.spec.grad_divisor
            replicated = self.replicate_group is not None
            inner = 1 if replicated else divisor  # with replicas: sum inside, divide once across
            received = None
            # the sum lands straight in the accumulated grads when it replaces them (the first
            # pass after zero_grad(set_to_none=True)); HSDP's step across the replicas is in place
            into_grads = self.strategy.shards_grads and not self.across_replicas and self._grads_restart()
            if self.strategy.shards_grads:
                reduced = (
                    self.grad if into_grads else self.pool.take(self.layout.shard_size, self.reduce_dtype, self.device)
                )
                scratch = C.reduce_scatter_scratch_numel(reduced, self.shard_group)
                if scratch:
                    received = self.pool.take(scratch, self.reduce_dtype, self.device)
                full = self._gradient_parts() if self.reduces_parts else staging
                with self._issuing(prefetch=False):  # nothing allocated here: the scratch is the compute stream's
                    exchange = C.reduce_scatter_avg(
                        reduced, full, self.shard_group, inner, async_op=True, label=self.label, scratch=received
                    )
            else:  # an all-reduce allocates its padded copies as it goes: issued from the compute stream
                reduced = staging
                exchange = C.all_reduce_avg(staging, self.group, inner, async_op=True, label=self.label)

            def accumulate() -> None:
                exchange.wait()
                total = self._reduce_across_replicas(reduced, divisor) if replicated else reduced
                if into_grads:  # total is self.grad
                    self.pool.give(staging, received)
                    return
                if self._grads_restart():
                    self.grad.copy_(total)
                else:
                    self.grad.add_(total)
                self.pool.give(staging, received, reduced)

            pending = C.Pending(None, accumulate)
        self.reshard()
        if pending is not None and not async_op:
            pending.wait()
            return None
        return pending

    def end_pass(self) -> None:
        self._reset_pass()

    # ---- the optimizer's view -------------------------------------------------------------
    def make_optimizer_param(self, i: int) -> nn.Parameter:
        """A parameter viewing the main params this rank owns of parameter ``i`` (shaped per the
        plan), whose ``.grad`` views the reduced gradients; the optimizer steps on it. The buffer
        keeps a weak link to relink the gradient after ``zero_grad(set_to_none=True)``."""
        if not self.requires_grad:
            raise ValueError(f"parameter '{self.names[i]}' does not require grad")
        sp = nn.Parameter(self.owned(self.main, i), requires_grad=True)
        sp.grad = self.owned(self.local_grad, i)
        self._optim_params[i] = weakref.ref(sp)
        return sp

    def _linked(self) -> list[tuple[int, nn.Parameter]]:
        return [(i, sp) for i, ref in self._optim_params.items() if (sp := ref()) is not None]

    def _grads_restart(self) -> bool:
        """The accumulated grads are about to be written: wait for a fence on them first, and
        say whether this pass's gradients replace them (see ``_restart_accumulation_if_zeroed``)."""
        await_fences((self,), grads_only=True)
        return self._restart_accumulation_if_zeroed()

    def _restart_accumulation_if_zeroed(self) -> bool:
        """``optimizer.zero_grad()`` (set_to_none) unlinks the optimizer params' grads: then the
        accumulated gradient starts again from zero, as PyTorch's own semantics say. Returns
        whether it restarts (the caller then overwrites the grads instead of adding to them)."""
        linked = self._linked()
        if not any(sp.grad is None for _, sp in linked):
            return False
        for i, sp in linked:
            sp.grad = self.owned(self.local_grad, i)
        return True

    @property
    def counts_in_norm(self) -> bool:
        """Whether this rank's owned gradients enter a global norm: replicated state (no_shard
        inside the group, HSDP across groups) counts on one replica; every instance of a group
        counts."""
        inside = self.shard_group is not None or C.group_rank(self.group) == 0
        return inside and (self.across_replicas or self.replicate_rank == 0)
