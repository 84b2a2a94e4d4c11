"""What an upcycled MoE model is to be (:class:`UpcycleSpec`) and the refusal of numbers no MoE
model can have (:func:`check_upcycle_spec`), without torch: ``mfsdp-ckpt upcycle`` refuses them before it
imports it, and :func:`mfsdp_ckpt.tools.upcycle.upcycle` before it reads the source."""

from __future__ import annotations

from dataclasses import dataclass

from mfsdp_ckpt.errors import ConversionError

__all__ = ["MAX_EXPERTS", "UpcycleSpec", "check_upcycle_spec"]

#: the most experts per layer: as many as a model config may declare (``mfsdp_ckpt.hf.config``'s
#: ``MAX_COUNT``, a module that imports torch; a test holds the two equal); the plan holds a key
#: per expert, so the bound comes before it is built
MAX_EXPERTS = 1 << 16


@dataclass(frozen=True)
class UpcycleSpec:
    """What the MoE model is to be: ``num_experts`` E, ``topk`` K, ``granularity`` G (each expert
    one of G slices of the FFN dimension; 1: whole copies) and the routers' ``seed``."""

    num_experts: int
    topk: int
    granularity: int = 1
    seed: int = 0


def check_upcycle_spec(src: str, spec: UpcycleSpec) -> None:
    """Refuse, naming ``src``, numbers no MoE model can have (before the source is read)."""
    e, k, g = spec.num_experts, spec.topk, spec.granularity
    if e < 1:
        raise ConversionError(f"{src}: --num-experts {e}: must be at least 1")
    if e > MAX_EXPERTS:
        raise ConversionError(f"{src}: --num-experts {e}: must be at most {MAX_EXPERTS} (a model config's limit)")
    if not 1 <= k <= e:
        raise ConversionError(f"{src}: --topk {k}: must be in [1, --num-experts {e}]")
    if g < 1:
        raise ConversionError(f"{src}: --granularity {g}: must be at least 1")
    if e % g or k % g:
        raise ConversionError(
            f"{src}: --granularity {g} must divide --num-experts {e} and --topk {k} "
            "(the router must pick whole groups of G experts for the MoE model to compute the dense one)"
        )
