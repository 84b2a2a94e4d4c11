"""``load`` into a model whose modules convert their state dicts with hooks, through those hooks.

A module may save a parameter under other names than its own: torchtitan's ``FusedQKVLinear``
holds one ``wqkv`` parameter and, through a state-dict hook, saves it as ``wq``/``wk``/``wv``
(rows interleaved per key/value head group), merging them back in a load-state-dict pre-hook. A
checkpoint of such a model names entries the sharded model does not have and lacks the
parameters it does have. :func:`load_with_state_dict_hooks` honours the module's own conversion:
it reads the entries the module's parameters lack whole (every chunk checked), runs the
module's own load pre-hooks on them, as ``nn.Module.load_state_dict`` does, and writes this
rank's range of each parameter they make; everything else loads as :func:`~mfsdp_ckpt.sharded.load.load`
loads it, with its checks and its atomicity (the converted parameters are computed and checked
before it starts, and copied only after it succeeded).
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import torch
from torch import nn

from mfsdp_ckpt.errors import StateMismatchError
from mfsdp_ckpt.format.keys import MAIN_PARAM, fqn_of_model_key, model_key, optim_key
from mfsdp_ckpt.read.locate import resolve_checkpoint
from mfsdp_ckpt.read.mapped import MappedReader
from mfsdp_ckpt.read.stock import KeyRule, hiding, parse_key_map
from mfsdp_ckpt.sharded.load import load
from mfsdp_ckpt.sharded.state import load_targets
from mfsdp_ckpt.write.agreement import agreed
from mfsdp_core import describe_shards, plan_of, refresh_compute_params
from mfsdp_core.collectives import rank0_decides

__all__ = ["load_with_state_dict_hooks"]


def load_with_state_dict_hooks(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    key_map: Sequence[str | KeyRule] = (),
    **kwargs: Any,
) -> dict[str, Any]:
    """:func:`~mfsdp_ckpt.sharded.load.load`, with the parameters that modules save under other
    names (through state-dict hooks) loaded through the modules' own load pre-hooks. Collective.

    Args:
        path: the checkpoint (as ``load`` takes it); e.g. a torchtitan checkpoint, read in its
            layout without a key map.
        model: the ``fully_shard``-ed model; every module of it with load-state-dict pre-hooks
            whose parameters the checkpoint lacks, and that has entries under its prefix the
            model lacks, gets those entries (whole tensors) through its hooks.
        optimizer: as for ``load`` (the optimizer's state is by parameter name: a fused
            parameter's is stored under its own name and loads as usual).
        key_map: as for ``load``.
        kwargs: the other arguments of ``load`` (``strict``, ``require_manifest``, ...).

    Returns:
        The ``extra`` values saved with the checkpoint, as ``load`` returns them.
    """
    rules = parse_key_map(key_map)
    directory = rank0_decides(resolve_checkpoint, path)
    converted, consumed = agreed(lambda: _convert(directory, model, rules))
    fresh = frozenset(kwargs.pop("fresh", ())) | {model_key(name) for name in converted}
    extra = load(directory, model, optimizer, key_map=[*rules, *hiding(consumed)], fresh=fresh, **kwargs)
    with torch.no_grad():
        for target in load_targets(describe_shards(model, optimizer), optimizer):
            full = converted.get(target.shard.fqn)
            if full is not None:
                lo, hi = target.shard.owned
                target.weights.copy_(full.reshape(-1)[lo:hi])
        refresh_compute_params(model)
    return extra


def _convert(directory: str, model: nn.Module, rules: Sequence[KeyRule]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The parameters the modules' load pre-hooks make of the checkpoint's entries (full tensors,
    checked against the model's shapes and dtypes), and the stored keys the hooks consumed."""
    planned = plan_of(model).params()
    converted: dict[str, torch.Tensor] = {}
    consumed: list[str] = []
    with MappedReader(directory, rules) as reader:
        keys = set(reader.keys())
        stored = {name: key for key in keys if (name := fqn_of_model_key(key)) is not None}
        for prefix, module in _hooked_modules(model):
            wanted = [
                n for n in planned if n.startswith(prefix) and n not in stored and optim_key(n, MAIN_PARAM) not in keys
            ]
            offered = [n for n in stored if n.startswith(prefix) and n not in planned]
            if not wanted or not offered:
                continue
            state = {n: reader.read(stored[n]) for n in offered}
            for hook in module._load_state_dict_pre_hooks.values():  # as nn.Module._load_from_state_dict calls them
                hook(state, prefix, {}, True, [], [], [])
            for name in wanted:
                if name in state:
                    spec, i = planned[name]
                    converted[name] = _checked(directory, name, state[name], tuple(spec.shapes[i]))
            consumed += [reader.source_key(model_key(n)) for n in offered if n not in state]
    return converted, consumed


def _hooked_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(prefix, module)`` of every module with load-state-dict pre-hooks, the prefix as the
    hooks get it (``layers.0.attention.qkv_linear.``)."""
    return [
        (f"{name}." if name else "", module)
        for name, module in model.named_modules()
        if module._load_state_dict_pre_hooks  # torch keeps them here; no public accessor
    ]


def _checked(directory: str, name: str, value: Any, shape: tuple[int, ...]) -> torch.Tensor:
    """``value``, the tensor a hook made for parameter ``name``, if it has the parameter's shape
    (a one-line :class:`StateMismatchError` otherwise)."""
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape:
        got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise StateMismatchError(
            f"{directory}: {model_key(name)}: the module's load hook made {got} of the checkpoint's entries; "
            f"the model's parameter is {shape}"
        )
    return value.contiguous()
