"""Megatron-Core ``torch_dist`` checkpoints in and out (mfsdp_ckpt.mcore), on the genuine
fixtures in fixtures/mcore/ (written by megatron-core 0.16.1; no Megatron needed here).

Tolerance of the logit comparisons: 1e-5 absolute on fp32 logits of magnitude ~0.4. Ours and
MCore's compute the same math in other orders (fused QKV split, unfused vs SDPA attention,
MCore's -10000 mask fill vs -inf, the experts' sums), so bitwise equality is not expected;
measured differences are ~1e-7. A wrong QKV row order, norm mapping or router order gives
differences of 1e-3 and more (the norms are randomised in the fixtures for that reason).
"""

from __future__ import annotations

import io
import json
import os
import shutil

import pytest
import torch

from mfsdp_ckpt.mcore import export_mcore, import_mcore
from mfsdp_ckpt.mcore.source import McoreSource
from mfsdp_ckpt.read.locate import is_mcore
from mfsdp_ckpt.read.reader import CheckpointReader
from mfsdp_core.models.gpt import GPTConfig, GPTModel

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
FIXTURES = os.path.join(ROOT, "fixtures", "mcore")
NAMES = ["dense", "moe_ep2", "tp2", "pp2", "v019/dense", "v019/moe_ep2"]  # v019/: megatron-core 0.19.2's layout
LOGIT_ATOL = 1e-5
#: the HF architecture that expresses each fixture's model (moe_ep2: MCore's default router =
#: Mixtral's). pp2 has none: moe_router_pre_softmax is Qwen3-MoE's norm_topk_prob false, but
#: Qwen3-MoE always has q/k norms, which the fixture does not.
HF_ARCH = {"dense": "llama", "tp2": "llama", "moe_ep2": "mixtral", "v019/dense": "llama", "v019/moe_ep2": "mixtral"}


def fixture(name: str) -> str:
    return os.path.join(FIXTURES, name)


def recorded(name: str) -> dict[str, torch.Tensor]:
    return torch.load(fixture(name) + ".logits.pt", weights_only=True)


def our_model(ckpt: str) -> GPTModel:
    """Our GPTModel with the weights of canonical checkpoint ``ckpt``."""
    with CheckpointReader(ckpt) as reader:
        model = GPTModel(GPTConfig.from_dict(reader.manifest["model_config"]))
        model.load_state_dict({k[len("model.") :]: reader.read(k) for k in reader.keys() if k.startswith("model.")})
    return model.eval()


def stock_read(directory: str) -> dict[str, object]:
    """Every entry of a DCP directory read by stock PyTorch (FileSystemReader + dcp.load), tensors
    in their global shapes, objects as loaded. (Stock DCP unpickles .metadata: only for the
    trusted fixtures and our own output.)"""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(directory)
    md = reader.read_metadata()
    state: dict[str, object] = {}
    for key, m in md.state_dict_metadata.items():
        state[key] = (
            torch.empty(tuple(m.size), dtype=m.properties.dtype)
            if isinstance(m, TensorStorageMetadata)
            else io.BytesIO()
        )
    dcp.load(state, storage_reader=reader, no_dist=True)
    return state


@pytest.mark.parametrize("name", NAMES)
def test_import_gives_mcores_logits(name, tmp_path):
    result = import_mcore(fixture(name), tmp_path / "ckpt", config=fixture(name) + ".config.json")
    assert result.step == 7 and result.assumed == []
    rec = recorded(name)
    with torch.no_grad():
        err = (our_model(str(tmp_path / "ckpt"))(rec["tokens"]) - rec["logits"]).abs().max().item()
    assert err <= LOGIT_ATOL, err
    with CheckpointReader(tmp_path / "ckpt") as reader:
        assert reader.read("extra.iteration") == 7 and reader.manifest["step"] == 7


def test_import_at_world_size_3_one_file_per_rank(tmp_path):
    result = import_mcore(fixture("moe_ep2"), tmp_path / "w3", world_size=3, config=fixture("moe_ep2") + ".config.json")
    assert sorted(n for n in os.listdir(result.path) if n.endswith(".distcp")) == [f"__{r}_0.distcp" for r in range(3)]
    rec = recorded("moe_ep2")
    with torch.no_grad():
        err = (our_model(result.path)(rec["tokens"]) - rec["logits"]).abs().max().item()
    assert err <= LOGIT_ATOL, err
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # the temporary checkpoint is gone


@pytest.mark.parametrize("name", ["dense", "moe_ep2", "v019/moe_ep2"])
def test_export_hf_of_the_mcore_checkpoint_matches_in_transformers(name, tmp_path):
    from transformers import AutoModelForCausalLM

    from mfsdp_ckpt.mcore import export_hf_from_mcore

    export_hf_from_mcore(fixture(name), tmp_path / "hf", fixture(name) + ".config.json", arch=HF_ARCH[name])
    rec = recorded(name)
    theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    with torch.no_grad():
        err = (theirs(rec["tokens"]).logits - rec["logits"]).abs().max().item()
    assert err <= LOGIT_ATOL, err
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]


@pytest.mark.parametrize("name", ["tp2", "v019/dense"])
def test_export_hf_of_the_import_matches_in_transformers(name, tmp_path):
    from transformers import AutoModelForCausalLM

    from mfsdp_ckpt import hf

    import_mcore(fixture(name), tmp_path / "ckpt", config=fixture(name) + ".config.json")
    hf.export(tmp_path / "ckpt", tmp_path / "hf", arch=HF_ARCH[name])
    rec = recorded(name)
    theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    with torch.no_grad():
        err = (theirs(rec["tokens"]).logits - rec["logits"]).abs().max().item()
    assert err <= LOGIT_ATOL, err


@pytest.mark.parametrize("name", NAMES)
def test_round_trip_is_bitwise_per_tensor(name, tmp_path):
    import_mcore(fixture(name), tmp_path / "ckpt", config=fixture(name) + ".config.json")
    export_mcore(tmp_path / "ckpt", tmp_path / "back")
    assert is_mcore(tmp_path / "back")
    original, back = stock_read(fixture(name)), stock_read(str(tmp_path / "back"))
    common = [k for k in original if k.startswith("common_state")]  # 0.19's common state: common.pt on the way back
    assert sorted(set(original) - set(common)) == sorted(back)
    for key, value in original.items():
        if key in common:
            continue
        if isinstance(value, torch.Tensor):
            assert value.dtype == back[key].dtype and torch.equal(value, back[key]), key
        else:  # objects: dcp.load gives them as loaded ([None] for every _extra_state here)
            assert value == back[key], key
    with McoreSource.open(fixture(name)) as a, McoreSource.open(tmp_path / "back") as b:
        assert a.common == b.common == {"iteration": 7}
    assert json.loads((tmp_path / "back" / "metadata.json").read_text())["common_backend"] == "torch"
    # and the export imports again without --config (it carries mcore_args.json)
    again = import_mcore(tmp_path / "back", tmp_path / "again")
    assert (
        again.model_config
        == import_mcore(fixture(name), tmp_path / "c2", config=fixture(name) + ".config.json").model_config
    )


def test_inspect_shows_an_mcore_checkpoint(tmp_path):
    from mfsdp_ckpt.tools.inspect import inspect_checkpoint

    info = inspect_checkpoint(fixture("moe_ep2"))
    assert info.format == "megatron-core torch_dist" and info.step == 7
    assert info.model_config is None and any("num_attention_heads" in u for u in info.unknown)
    shutil.copytree(fixture("dense"), tmp_path / "dense")
    shutil.copy(fixture("dense") + ".config.json", tmp_path / "dense" / "mcore_args.json")
    info = inspect_checkpoint(tmp_path / "dense")
    assert info.model_config["num_attention_heads"] == 4 and info.model_config["kv_channels"] == 16
