"""Mixed-precision settings for :func:`mfsdp_core.fully_shard`."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MixedPrecision:
    """``param_dtype``: the dtype the module computes with (None: the parameter's own dtype).
    ``main_dtype``: the optimizer's main (master) parameters, sharded per the strategy.
    ``reduce_dtype``: gradients are reduced and accumulated in this dtype; it must equal
    ``main_dtype`` because the optimizer reads the accumulated gradient in place.
    Floating-point forward inputs are cast to ``param_dtype``."""

    param_dtype: torch.dtype | None = None
    main_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.reduce_dtype != self.main_dtype:
            raise ValueError(
                f"MixedPrecision: reduce_dtype {self.reduce_dtype} must equal main_dtype {self.main_dtype}"
            )
