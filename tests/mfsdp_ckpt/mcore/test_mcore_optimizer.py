"""A trained checkpoint through ``export-mcore`` then ``import-mcore`` keeps its optimizer state bit
for bit, and the export holds it as MCore's distributed optimizer writes it with sharding type
``fully_reshardable``: ``optimizer.state.{param,exp_avg,exp_avg_sq}.<key>`` tensors, the step once,
in ``common.pt``'s param groups, no ``optimizer.state.step.*``. (That genuine MCore loads it:
``tests/cli/test_train_mcore.py::test_trained_mcore_checkpoint_loads_strictly_in_megatron_and_matches_transformers``.)"""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from cli.main import main
from mfsdp_ckpt.errors import ConversionError
from mfsdp_ckpt.mcore import export as mcore_export
from mfsdp_ckpt.read.mapped import MappedReader
from tests.mfsdp_ckpt.mcore.test_mcore import stock_read
from tests.torchrun import failure, run_train


def _bits(value):
    """A tensor as (dtype, shape, raw bytes): equal only when bitwise equal (NaNs, -0.0 included)."""
    if not isinstance(value, torch.Tensor):
        return value
    return value.dtype, tuple(value.shape), value.contiguous().reshape(-1).view(torch.uint8).tolist()


def _state(path) -> dict:
    """Every ``model.*`` and ``optim.*`` entry of a canonical checkpoint, as :func:`_bits`."""
    with MappedReader(str(path)) as reader:
        return {k: _bits(reader.read(k)) for k in reader.keys() if k.startswith(("model.", "optim."))}


def _cli(*args: str) -> None:
    res = CliRunner().invoke(main, list(args))
    assert res.exit_code == 0, (args, res.output, res.exception)


@pytest.mark.parametrize("model, dtype", [("tiny-moe", "fp32"), ("tiny", "bf16")], ids=["moe-fp32", "bf16-main-params"])
def test_trained_checkpoint_round_trips_through_mcore_with_its_optimizer_state(model, dtype, tmp_path):
    run = run_train(
        None,
        *("--model", model, "--dtype", dtype, "--steps", "2", "--batch-size", "2", "--seq-len", "16"),
        *("--ckpt-dir", str(tmp_path / "run"), "--save-every", "2"),
    )
    assert run.returncode == 0, failure(run)
    ckpt, mc, back = tmp_path / "run" / "step_000002", tmp_path / "mc", tmp_path / "back"
    _cli("export-mcore", str(ckpt), str(mc))
    _cli("import-mcore", str(mc), str(back))

    original, again = _state(ckpt), _state(back)
    assert any(k.endswith(".step") for k in original) and "optim.param_groups" in original
    assert (dtype == "bf16") == any(k.endswith(".main_param") for k in original)
    assert sorted(again) == sorted(original)
    assert [k for k in original if again[k] != original[k]] == []

    stored = stock_read(str(mc))
    optim = [k for k in stored if k.startswith("optimizer.")]
    assert not [k for k in optim if k.startswith("optimizer.state.step.")]
    states = {k.split(".")[2] for k in optim}
    assert states == {"param", "exp_avg", "exp_avg_sq"}, states
    per_state = {s: {k.split(".", 3)[3] for k in optim if k.split(".")[2] == s} for s in states}
    assert per_state["param"] == per_state["exp_avg"] == per_state["exp_avg_sq"]
    assert all(stored[f"optimizer.state.param.{k}"].dtype == torch.float32 for k in per_state["param"])

    common = torch.load(mc / "common.pt", weights_only=True)["optimizer"]
    assert common["param_state_sharding_type"] == "fully_reshardable"
    groups = common["optimizer"]["param_groups"]
    assert len(groups) == len(original["optim.param_groups"]) and {g["step"] for g in groups} == {2}


class _Steps:
    """A reader of nothing but optimizer steps (what :func:`mcore_export._optimizer_step` reads)."""

    directory = "CKPT"

    def __init__(self, steps: dict[str, object]) -> None:
        self.steps = steps

    def read(self, key: str) -> object:
        return self.steps[key]


def test_steps_that_differ_are_refused_naming_both_keys():
    same = _Steps({"optim.a.weight.step": torch.tensor(3.0), "optim.b.weight.step": torch.tensor(3.0)})
    assert mcore_export._optimizer_step(same, list(same.steps)) == 3
    differ = _Steps({"optim.a.weight.step": torch.tensor(3.0), "optim.b.weight.step": torch.tensor(2.0)})
    with pytest.raises(ConversionError) as err:
        mcore_export._optimizer_step(differ, list(differ.steps))
    assert str(err.value) == (
        "CKPT: key 'optim.b.weight.step': optimizer step 2, but 'optim.a.weight.step' 3: MCore's optimizer "
        "keeps one step for all parameters; export the weights alone (reshard --model-only first)"
    )
