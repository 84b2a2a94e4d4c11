"""Sharding strategies: which training state is split across the data-parallel ranks."""

from __future__ import annotations

from enum import Enum


class Strategy(str, Enum):
    """What is sharded. ZeRO-1 keeps full (all-reduced) gradients on every rank; ZeRO-2 shards
    them too (reduce-scatter); ZeRO-3 also shards the parameters and gathers them per module."""

    NO_SHARD = "no_shard"
    OPTIM = "optim"  # ZeRO-1: optimizer state and fp32 main params
    OPTIM_GRADS = "optim_grads"  # ZeRO-2: + gradients
    OPTIM_GRADS_PARAMS = "optim_grads_params"  # ZeRO-3: + parameters

    @property
    def shards_optim(self) -> bool:
        return self is not Strategy.NO_SHARD

    @property
    def shards_grads(self) -> bool:
        return self in (Strategy.OPTIM_GRADS, Strategy.OPTIM_GRADS_PARAMS)

    @property
    def shards_params(self) -> bool:
        return self is Strategy.OPTIM_GRADS_PARAMS


STRATEGY_NAMES = tuple(s.value for s in Strategy)


def parse_strategy(spec: str | Strategy) -> Strategy:
    """Parse a strategy name (``no_shard``, ``optim``, ``optim_grads``, ``optim_grads_params``)."""
    if isinstance(spec, Strategy):
        return spec
    try:
        return Strategy(spec)
    except ValueError:
        raise ValueError(f"unknown sharding strategy {spec!r}; expected one of {', '.join(STRATEGY_NAMES)}") from None
