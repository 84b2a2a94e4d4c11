"""Helpers for checkpoint tests: training a test model over a step range, and this rank's owned
pieces of every canonical tensor (to assemble / compare logical tensors across layouts)."""

from __future__ import annotations

import torch

from mfsdp_core import describe_shards, fully_shard_optimizer
from tests.mfsdp_core.models import make_adamw, make_model, shard_model, train_steps  # noqa: F401 (train_steps: re-exported)


def build(strategy: str, policy: str, seed: int = 0, name: str = "transformer"):
    model = shard_model(make_model(name, seed=seed), strategy=strategy, policy=policy)
    return model, fully_shard_optimizer(make_adamw(model.parameters()))


def owned_pieces(model, optim, grads: bool = False) -> dict[str, tuple[int, int, torch.Tensor]]:
    """Canonical key -> (start, end, values) of the range this rank owns."""
    out = {}
    for ps in describe_shards(model, optim):
        lo, hi = ps.owned
        param = ps.param.tensor[lo - ps.param.start : hi - ps.param.start]
        out[f"model.{ps.fqn}"] = (lo, hi, param.clone())
        out[f"main.{ps.fqn}"] = (lo, hi, ps.main.tensor.clone())
        for k, fs in ps.optim.items():
            out[f"optim.{ps.fqn}.{k}"] = (lo, hi, fs.tensor.clone())
        if grads:
            g = ps.grad.tensor[lo - ps.grad.start : hi - ps.grad.start]
            out[f"grad.{ps.fqn}"] = (lo, hi, g.clone())
    return out


def assemble(per_rank: list[dict], shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """Full logical tensors from every rank's owned pieces; asserts each element is covered
    exactly once (replicated ranks owning the same range must agree bitwise)."""
    full = {}
    for key in per_rank[0]:
        fqn = key.split(".", 1)[1]
        fqn = fqn.rsplit(".", 1)[0] if key.startswith("optim.") else fqn
        numel = shapes[fqn].numel()
        flat = torch.full((numel,), float("nan"), dtype=per_rank[0][key][2].dtype)
        seen = torch.zeros(numel, dtype=torch.int32)
        ranges = {}
        for pieces in per_rank:
            lo, hi, values = pieces[key]
            if (lo, hi) in ranges:  # a replica (no_shard): must be identical
                assert torch.equal(ranges[(lo, hi)], values), key
                continue
            ranges[(lo, hi)] = values
            flat[lo:hi] = values
            seen[lo:hi] += 1
        assert bool((seen == 1).all()), f"{key}: elements covered {seen.min().item()}..{seen.max().item()} times"
        full[key] = flat.view(shapes[fqn])
    return full


def shapes_of(name: str = "transformer") -> dict[str, torch.Size]:
    return {n: p.shape for n, p in make_model(name).named_parameters()}


def owned_state(model, optim) -> dict[str, tuple[int, torch.Tensor]]:
    """Key -> (start, values) of everything this rank owns: main params (``main.``), optimizer
    tensors (``optim.``) and scalars (``scalar.``, start 0), companion planes (``mx.``, as bytes:
    fp8 tensors do not pickle between processes). Keys may differ between ranks (experts, whole
    tensors on one rank), unlike :func:`owned_pieces`; join them with :func:`joined`."""
    out = {}
    for ps in describe_shards(model, optim):
        out[f"main.{ps.fqn}"] = (ps.main.start, ps.main.tensor.clone())
        for k, v in ps.optim.items():
            out[f"optim.{ps.fqn}.{k}"] = (v.start, v.tensor.clone())
        for k, v in ps.optim_extra.items():
            out[f"scalar.{ps.fqn}.{k}"] = (0, v.clone() if isinstance(v, torch.Tensor) else torch.tensor(v))
        for name, plane in ps.companions.items():
            out[f"mx.{ps.fqn}.{name}"] = (plane.start, plane.tensor.view(torch.uint8).clone())
    return out


def joined(per_rank: list[dict[str, tuple[int, torch.Tensor]]]) -> dict[str, torch.Tensor]:
    """Each key's flat values from every rank's pieces (:func:`owned_state`), in order. Asserts the
    pieces tile the range without gap or overlap, and that replicas (the same start: ``no_shard``,
    scalars) agree bitwise."""
    parts: dict[str, dict[int, torch.Tensor]] = {}
    for state in per_rank:
        for key, (start, t) in state.items():
            if not t.numel():
                continue
            t = t.reshape(-1)
            seen = parts.setdefault(key, {})
            if start in seen:
                assert torch.equal(seen[start], t), f"{key}: replicas at {start} differ"
                continue
            seen[start] = t
    out = {}
    for key, pieces in parts.items():
        at = 0
        for start in sorted(pieces):
            assert start == at, f"{key}: pieces leave a gap or overlap at {at}"
            at += pieces[start].numel()
        out[key] = torch.cat([pieces[s] for s in sorted(pieces)])
    return out


def as_listed(path: str) -> str:
    """Rewrite the manifest of a checkpoint ``save`` wrote in the listed form: every chunk's place
    and crc32c in ``chunks``, no index (what the offline tools write, and saves before format
    version 3). Its readers then take ``.metadata`` and the chunk table: the tests of their
    defences against a hostile ``.metadata`` or chunk table run on it."""
    import json
    import os

    from mfsdp_ckpt.read.locate import chunk_table
    from mfsdp_ckpt.write.manifest import write_manifest

    table = chunk_table(path)
    with open(os.path.join(path, "mfsdp.json")) as f:
        manifest = json.load(f)
    manifest.pop("index")
    manifest["chunks"] = table
    write_manifest(path, manifest)
    return path
