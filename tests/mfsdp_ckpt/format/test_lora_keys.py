"""A LoRA checkpoint's adapters found by name (``adapter_pairs``): each factor with its partner and
the base weight it adapts, shapes that compose at the recorded rank, and one line naming the key
for anything else (adapters without a record, a record without adapters); PEFT's names."""

from __future__ import annotations

import pytest

from mfsdp_ckpt.errors import ConversionError
from mfsdp_ckpt.format.lora import LoraSpec, adapter_pairs, peft_name

SPEC = LoraSpec(4, 8.0, ("q_proj",))
Q = "model.model.layers.0.self_attn.q_proj"
BASE = {f"{Q}.weight": (32, 16), "model.lm_head.weight": (96, 16)}
GOOD = {**BASE, f"{Q}.lora_A.weight": (4, 16), f"{Q}.lora_B.weight": (32, 4)}


def test_pairs_and_names():
    assert adapter_pairs(GOOD, SPEC, "ck") == {f"{Q}.weight": (f"{Q}.lora_A.weight", f"{Q}.lora_B.weight")}
    assert adapter_pairs(BASE, None, "ck") == {}
    assert peft_name(f"{Q}.lora_A.weight") == "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert SPEC.scale == 2.0


@pytest.mark.parametrize(
    "shapes, spec, why",
    [
        (BASE, SPEC, "ck: model_source records LoRA adapters (r=4,alpha=8,targets=q_proj) but it holds none"),
        (GOOD, None, f"ck: {Q}.lora_A.weight is a LoRA factor but model_source records no lora (its scale)"),
        ({**BASE, f"{Q}.lora_A.weight": (4, 16)}, SPEC, f"ck: {Q}.lora_A.weight has no partner lora_B"),
        ({**BASE, f"{Q}.lora_B.weight": (32, 4)}, SPEC, f"ck: {Q}.lora_B.weight has no partner lora_A"),
        (
            {k: v for k, v in GOOD.items() if k != f"{Q}.weight"},
            SPEC,
            f"ck: {Q}.lora_A.weight adapts {Q}.weight, which the checkpoint does not hold",
        ),
        (
            {**GOOD, f"{Q}.lora_B.weight": (32, 8)},
            SPEC,
            f"ck: {Q}.lora_A.weight (4, 16) and {Q}.lora_B.weight (32, 8) do not adapt {Q}.weight (32, 16) with r=4",
        ),
        (
            {**GOOD, f"{Q}.lora_A.weight": (4, 32)},
            SPEC,
            f"ck: {Q}.lora_A.weight (4, 32) and {Q}.lora_B.weight (32, 4) do not adapt {Q}.weight (32, 16) with r=4",
        ),
    ],
)
def test_what_does_not_compose_is_named(shapes, spec, why):
    with pytest.raises(ConversionError) as e:
        adapter_pairs(shapes, spec, "ck")
    assert str(e.value) == why
