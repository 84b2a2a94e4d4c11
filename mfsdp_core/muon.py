"""Muon: momentum orthogonalized by Newton–Schulz for the hidden matrices, AdamW for the rest.

For a weight ``W [rows, cols]`` with gradient ``G``, per step (Keller Jordan's Muon):

    B ← μ·B + G                                  (momentum buffer, ``momentum_buffer``)
    U ← G + μ·B   with ``nesterov``, else U ← B
    O ← NS5(U)                                   (≈ the orthogonal factor of U's polar decomposition)
    W ← W·(1 − lr·wd) − lr·s·O,   s = max(1, rows/cols)^½

``NS5`` is the quintic Newton–Schulz iteration: X₀ = U / (‖U‖_F + 1e-7) (transposed when
rows > cols, so that X Xᵀ is the smaller Gram matrix), then 5 times
``X ← a·X + (b·A + c·A²)·X`` with ``A = X Xᵀ`` and (a, b, c) = (3.4445, −4.7750, 2.0315), in
``ns_dtype`` (bf16 by default, or fp32). The scale ``s`` keeps the update's RMS comparable across
shapes for tall matrices (the original Muon's rule).

Which parameters: a param group with ``use_muon=True`` gets Muon; the others get AdamW
(decoupled weight decay, bias-corrected, ``betas``, ``eps``). :func:`muon_param_groups` applies the
rule of this project: Muon for every 2-D weight except embeddings and the output layer (so the
transformer layers' projections, experts and routers); AdamW for embeddings, the output layer,
norms, biases and every other non-matrix.

Sharded (adapted by ``fully_shard_optimizer``), a Muon step needs the whole matrix:

- under ``tensor`` placement (or ``no_shard``) each matrix lies whole on one rank, which computes
  its update with no communication;
- under flat placements (``even``, ``row``, ``block``) each matrix gets a deterministic owner in
  its shard group, balanced by Newton–Schulz cost; one ``all_to_all`` sends every rank's piece of
  ``U`` to the owner, the owner runs NS5, and one ``all_to_all`` sends each rank its piece of
  ``O`` back (in ``ns_dtype``). Each element of each matrix travels once each way.

Both give the same numbers as one process: the elementwise steps are written without fused
multiply-adds, so a piece computes what the whole tensor would, and the owner runs NS5 on the
same matrix.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import torch
from torch import nn

from mfsdp_core import collectives as C

__all__ = ["Muon", "newton_schulz5", "muon_param_groups", "uses_muon", "muon_owners"]

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def newton_schulz5(u: torch.Tensor, steps: int = 5, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The quintic Newton–Schulz orthogonalization of a matrix ``u`` (module doc), in ``dtype``."""
    a, b, c = NS_COEFFICIENTS
    x = u.to(dtype)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.mT
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        gram = x @ x.mT
        poly = b * gram + c * (gram @ gram)
        x = a * x + poly @ x
    return x.mT if tall else x


def uses_muon(name: str, param: nn.Parameter) -> bool:
    """This project's rule: Muon for 2-D weights that are neither an embedding nor the output
    layer (by name: ``embedding``/``embed``, ``output_layer``/``lm_head``)."""
    if param.ndim != 2:
        return False
    lowered = name.lower()
    return not any(k in lowered for k in ("embedding", "embed_tokens", "output_layer", "lm_head"))


def muon_param_groups(
    model: nn.Module,
    *,
    lr: float = 0.02,
    weight_decay: float = 0.0,
    adamw_lr: float = 3e-3,
    adamw_weight_decay: float = 0.0,
) -> list[dict[str, Any]]:
    """Param groups for :class:`Muon` by :func:`uses_muon`: one Muon group (``lr``,
    ``weight_decay``), one AdamW group (``adamw_lr``, ``adamw_weight_decay``)."""
    muon, other = [], []
    for name, p in model.named_parameters():
        (muon if uses_muon(name, p) else other).append(p)
    return [
        {"params": muon, "use_muon": True, "lr": lr, "weight_decay": weight_decay},
        {"params": other, "use_muon": False, "lr": adamw_lr, "weight_decay": adamw_weight_decay},
    ]


def muon_owners(costs: list[int], ranks: int) -> list[int]:
    """Each matrix's owner among ``ranks``: greedily, the costliest first onto the least loaded
    rank (ties: the lower rank). Deterministic: every rank computes the same list."""
    load = [0] * ranks
    owners = [0] * len(costs)
    for m in sorted(range(len(costs)), key=lambda m: (-costs[m], m)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        owners[m] = r
        load[r] += costs[m]
    return owners


class Muon(torch.optim.Optimizer):
    """Muon for groups with ``use_muon=True``, AdamW for the others (module doc). ``lr`` of a
    group is its own: Muon groups typically use about 0.02, AdamW groups about 3e-3.

    ``ns_dtype``: ``"bfloat16"`` or ``"float32"``. Works on plain parameters and, after
    ``fully_shard_optimizer``, on the shards of a ``fully_shard``-ed model (module doc)."""

    def __init__(
        self,
        params: Iterable,
        lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.0,
        ns_steps: int = 5,
        ns_dtype: str = "bfloat16",
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        use_muon: bool = True,
    ) -> None:
        if ns_dtype not in NS_DTYPES:
            raise ValueError(f"Muon: ns_dtype must be one of {', '.join(NS_DTYPES)}, got {ns_dtype!r}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"Muon: momentum must be in [0, 1), got {momentum}")
        defaults = dict(
            lr=lr,
            momentum=momentum,
            nesterov=nesterov,
            weight_decay=weight_decay,
            ns_steps=ns_steps,
            ns_dtype=ns_dtype,
            betas=betas,
            eps=eps,
            use_muon=use_muon,
        )
        super().__init__(params, defaults)
        for group in self.param_groups:
            if group["use_muon"]:
                for p in group["params"]:
                    if p.ndim != 2 and not _flat_matrix(self, p):
                        raise ValueError(
                            f"Muon: a use_muon group holds a parameter of shape {tuple(p.shape)}; "
                            "Muon needs matrices (give it to an AdamW group: use_muon=False)"
                        )

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        muon = []
        for group in self.param_groups:
            if group["use_muon"]:
                muon.extend((group, p) for p in group["params"] if p.grad is not None)
            else:
                for p in group["params"]:
                    if p.grad is not None:
                        self._adamw(group, p)
        self._muon(muon)
        return loss

    # ---- AdamW ----------------------------------------------------------------------------
    def _adamw(self, group: dict, p: torch.Tensor) -> None:
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
        beta1, beta2 = group["betas"]
        state["step"] += 1
        t = float(state["step"])
        g = p.grad
        state["exp_avg"].mul_(beta1).add_(g * (1 - beta1))
        state["exp_avg_sq"].mul_(beta2).add_(g * g * (1 - beta2))
        denom = (state["exp_avg_sq"] / (1 - beta2**t)).sqrt_().add_(group["eps"])
        p.mul_(1 - group["lr"] * group["weight_decay"])
        p.sub_(state["exp_avg"] / denom * (group["lr"] / (1 - beta1**t)))

    # ---- Muon -----------------------------------------------------------------------------
    def _muon(self, items: list[tuple[dict, torch.Tensor]]) -> None:
        """Momentum and the Newton–Schulz input on this rank's pieces; the update where each
        matrix is whole (here, or on its owner after one all-to-all); then apply it."""
        inputs = {}
        for group, p in items:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p)
            buf = state["momentum_buffer"]
            buf.mul_(group["momentum"]).add_(p.grad)
            if group["nesterov"]:
                inputs[p] = (buf * group["momentum"]).add_(p.grad)
            else:
                inputs[p] = buf.clone()
        updates = _orthogonalized(self, items, inputs)
        for group, p in items:
            update = updates.get(p)
            if update is None:  # an empty piece: nothing of this matrix lies here
                continue
            rows, cols = _matrix_shape(self, p)
            scale = max(1.0, rows / cols) ** 0.5
            p.mul_(1 - group["lr"] * group["weight_decay"])
            p.sub_(update.float().view_as(p) * (group["lr"] * scale))


def _matrix_shape(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> tuple[int, int]:
    """The full matrix shape behind ``p`` (``p`` itself, or a shard of a ``fully_shard``-ed one)."""
    owner = _owner(optimizer, p)
    if owner is None:
        return int(p.shape[0]), int(p.shape[1])
    buf, i = owner
    shape = buf.layout.shapes[i]
    return int(shape[0]), math.prod(shape[1:])


def _flat_matrix(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> bool:
    owner = _owner(optimizer, p)
    return owner is not None and len(owner[0].layout.shapes[owner[1]]) == 2


def _owner(optimizer: torch.optim.Optimizer, p: torch.Tensor):
    from mfsdp_core.optim import shard_of  # the adapter, when there is one

    return shard_of(optimizer, p)


def _orthogonalized(
    optimizer: Muon, items: list[tuple[dict, torch.Tensor]], inputs: dict[torch.Tensor, torch.Tensor]
) -> dict[torch.Tensor, torch.Tensor]:
    """``NS5(U)`` for each matrix, as this rank's piece of it (absent for an empty piece)."""
    out: dict[torch.Tensor, torch.Tensor] = {}
    flat: dict[int, list] = {}  # shard group -> [(group, p, buf, index)]
    for group, p in items:
        owner = _owner(optimizer, p)
        dtype = NS_DTYPES[group["ns_dtype"]]
        if owner is None or owner[0].spec.shaped_optimizer_state or owner[0].layout.group_size == 1:
            if p.numel():  # whole here (tensor placement, no_shard, one rank, an unsharded model)
                rows, cols = _matrix_shape(optimizer, p)
                out[p] = newton_schulz5(inputs[p].view(rows, cols), group["ns_steps"], dtype).reshape(p.shape)
            continue
        if owner[0].across_replicas:
            raise ValueError(
                f"Muon: parameter '{owner[0].names[owner[1]]}' is split over the replicas (HFSDP) by a flat "
                f"policy ({owner[0].spec.policy}); use policy tensor, or HSDP"
            )
        flat.setdefault(id(owner[0].shard_group), []).append((group, p, *owner))
    for members in flat.values():
        out.update(_owner_compute(optimizer, members, inputs))
    return out


def _owner_compute(
    optimizer: Muon, members: list, inputs: dict[torch.Tensor, torch.Tensor]
) -> dict[torch.Tensor, torch.Tensor]:
    """The matrices of one shard group: pieces of U to their owners, NS5 there, pieces of O back."""
    first_buf = members[0][2]
    group_pg = first_buf.shard_group
    n, me = first_buf.layout.group_size, first_buf.shard_rank
    shapes = [_matrix_shape(optimizer, p) for _, p, _, _ in members]
    owners = muon_owners([r * c * min(r, c) for r, c in shapes], n)
    pieces = [[buf.layout.piece(i, r) for r in range(n)] for _, _, buf, i in members]
    dtypes = {NS_DTYPES[g["ns_dtype"]] for g, _, _, _ in members}
    wire = torch.bfloat16 if dtypes == {torch.bfloat16} else torch.float32

    # 1. every rank's piece of U to the matrix's owner
    send = [inputs[p].reshape(-1) for d in range(n) for m, (_, p, _, _) in enumerate(members) if owners[m] == d]
    send_splits = [sum(pieces[m][me].numel for m in range(len(members)) if owners[m] == d) for d in range(n)]
    recv_splits = [sum(pieces[m][s].numel for m in range(len(members)) if owners[m] == me) for s in range(n)]
    sent = torch.cat(send) if send else torch.zeros(0)
    received = C.all_to_all_rows(sent, send_splits, recv_splits, group_pg)

    # 2. the owner assembles each of its matrices, in rank order, and orthogonalizes it
    mine = [m for m in range(len(members)) if owners[m] == me]
    whole = {m: torch.empty(shapes[m][0] * shapes[m][1], dtype=sent.dtype) for m in mine}
    at = 0
    for s in range(n):
        for m in mine:
            pc = pieces[m][s]
            whole[m][pc.start : pc.end] = received[at : at + pc.numel]
            at += pc.numel
    results = {}
    for m in mine:
        group = members[m][0]
        rows, cols = shapes[m]
        results[m] = (
            newton_schulz5(whole[m].view(rows, cols), group["ns_steps"], NS_DTYPES[group["ns_dtype"]])
            .reshape(-1)
            .to(wire)
        )

    # 3. each rank's piece of O back from the owner
    back = [results[m][pieces[m][d].start : pieces[m][d].end] for d in range(n) for m in mine]
    returned = C.all_to_all_rows(
        torch.cat(back) if back else torch.zeros(0, dtype=wire), recv_splits, send_splits, group_pg
    )
    out, at = {}, 0
    for s in range(n):
        for m in range(len(members)):
            if owners[m] == s:
                size = pieces[m][me].numel
                if size:
                    out[members[m][1]] = returned[at : at + size]
                at += size
    return out
