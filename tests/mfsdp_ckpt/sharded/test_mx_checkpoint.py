"""MX planes in checkpoints: saved on block boundaries next to the fp32 main params, loaded at other
world sizes bitwise, checked against the main params on load, resharded offline on block
boundaries, shown by inspect (real gloo processes)."""

from __future__ import annotations

import json
import os
import shutil
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from click.testing import CliRunner

import mfsdp_ckpt
from cli.main import main as cli
from mfsdp_ckpt.read.reader import CheckpointReader
from mfsdp_ckpt.sharded.reshard import reshard
from mfsdp_core import (
    MixedPrecision,
    Placement,
    describe_shards,
    fully_shard,
    fully_shard_optimizer,
)
from mfsdp_core.models.gpt import GPTModel, get_preset, linear_weights, shard_units
from mfsdp_core.mx import MXFormat, quantize
from mfsdp_core.plan import mx_placement
from tests.mfsdp_ckpt.util import joined, owned_state

warnings.filterwarnings("ignore", message=".*native MXFP8 cast unavailable.*")
CONFIG = get_preset("tiny")
PLANES = ("rowwise_data", "rowwise_scale", "columnwise_data", "columnwise_scale")


def _build(strategy: str = "optim_grads_params", bf16: bool = False, fmt: MXFormat | None = None):
    torch.manual_seed(0)
    model = GPTModel(CONFIG)
    marked = {id(p) for p in linear_weights(model)}
    place = lambda n, p: mx_placement(fmt) if id(p) in marked else Placement("block(32)")  # noqa: E731
    mp = MixedPrecision(param_dtype=torch.bfloat16 if bf16 else None)
    for unit in shard_units(model):
        fully_shard(unit, strategy=strategy, placement=place, mixed_precision=mp)
    return model, fully_shard_optimizer(torch.optim.AdamW(model.parameters(), lr=3e-3))


def _train_and_save(
    path: str, strategy: str = "optim_grads_params", bf16: bool = False, corrupt_plane: bool = False
) -> dict:
    model, optim = _build(strategy, bf16)
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(2):
        tokens = torch.randint(0, CONFIG.vocab_size, (6, 17), generator=torch.Generator().manual_seed(step))
        mine = tokens[rank * 6 // world : (rank + 1) * 6 // world]
        logits = model(mine[:, :-1])
        F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), mine[:, 1:].reshape(-1)).backward()
        optim.step()
        optim.zero_grad()
    if corrupt_plane:  # a plane that its checksums will vouch for, but not its main params
        for ps in describe_shards(model):
            if ps.fqn == "decoder.layers.1.mlp.linear_fc2.weight" and ps.companions["rowwise_scale"].tensor.numel():
                scale = ps.companions["rowwise_scale"].tensor.view(torch.uint8)
                scale[3] += 1
    mfsdp_ckpt.save(path, model, optim)
    return owned_state(model, optim)


def _load(path: str, strategy: str = "optim_grads_params", bf16: bool = False, with_optim: bool = True) -> dict:
    model, optim = _build(strategy, bf16)
    before = owned_state(model, optim)
    try:
        mfsdp_ckpt.load(path, model, optim if with_optim else None)
    except mfsdp_ckpt.CheckpointError as e:
        after = owned_state(model, optim)
        unchanged = all(torch.equal(before[k][1], after[k][1]) for k in before if not k.startswith("optim."))
        return {"error": str(e), "unchanged": unchanged}
    return owned_state(model, optim)


@pytest.mark.heavy
def test_planes_load_at_other_world_sizes_bitwise(ranks, tmp_path):
    """Saved at 3 ranks (ZeRO-3), loaded at 2 (ZeRO-2) and 4 (ZeRO-3): main params, optimizer
    state and all four planes of every MX weight bitwise equal, and the planes equal quantizing the
    whole main params."""
    saved = joined(ranks(_train_and_save, 3, str(tmp_path / "ckpt"), timeout=300))
    mx_keys = [k for k in saved if k.startswith("mx.")]
    assert len(mx_keys) == 4 * len(linear_weights(GPTModel(CONFIG)))
    for world, strategy in ((2, "optim_grads"), (4, "optim_grads_params")):
        loaded = joined(ranks(_load, world, str(tmp_path / "ckpt"), strategy, timeout=300))
        assert sorted(loaded) == sorted(saved)
        for key in saved:
            assert torch.equal(loaded[key], saved[key]), (world, key)
    fqn = "decoder.layers.0.mlp.linear_fc1.weight"
    main = saved[f"main.{fqn}"].view(256, 64)
    for axis, prefix in (("row", "rowwise"), ("col", "columnwise")):
        data, scale = quantize(main, MXFormat(), axis)
        assert torch.equal(saved[f"mx.{fqn}.{prefix}_data"], data.reshape(-1).view(torch.uint8))
        assert torch.equal(saved[f"mx.{fqn}.{prefix}_scale"], scale.reshape(-1).view(torch.uint8))


def test_a_plane_that_disagrees_with_its_main_params_is_named_by_block(ranks, tmp_path):
    """A scale byte changed before the save (so every checksum vouches for it): the load re-derives
    the planes from the main params, names the first differing block, and changes nothing."""
    ranks(_train_and_save, 3, str(tmp_path / "ckpt"), "optim_grads_params", False, True, timeout=300)
    out = ranks(_load, 2, str(tmp_path / "ckpt"), timeout=300)
    key = "mx.decoder.layers.1.mlp.linear_fc2.weight.rowwise_scale"
    for o in out:
        assert o["unchanged"], o
        assert f"key '{key}': the saved plane differs from the one derived from the main params" in o["error"], o
        assert "at the block of row " in o["error"] and "(saved byte 0x" in o["error"], o
    assert len({o["error"] for o in out}) == 1  # the same line on every rank


def test_a_flipped_byte_in_a_saved_scale_plane_is_caught(ranks, tmp_path):
    """A byte flipped on disk inside a scale plane's stored bytes: the load refuses it (its
    crc32c) on every rank, naming the key, and the model is unchanged."""
    from mfsdp_ckpt.read.locate import open_checkpoint

    path = tmp_path / "ckpt"
    saved = joined(ranks(_train_and_save, 3, str(path), timeout=300))
    key = "mx.decoder.layers.0.self_attention.linear_qkv.weight.columnwise_scale"
    _, _, _, verifying = open_checkpoint(str(path))
    index, info = max(verifying.stored[key], key=lambda chunk: chunk[1].length)
    cols = 64
    rows = verifying.read_metadata().state_dict_metadata[key].chunks
    chunk = next(c for c in rows if tuple(c.offsets) == tuple(index.offset))
    payload = saved[key][chunk.offsets[0] * cols : (chunk.offsets[0] + chunk.sizes[0]) * cols].numpy().tobytes()
    file = path / info.relative_path
    data = bytearray(file.read_bytes())
    at = data.find(payload, info.offset, info.offset + info.length)
    assert at >= 0 and payload
    data[at + 1] ^= 0x01
    file.write_bytes(bytes(data))
    out = ranks(_load, 2, str(path), timeout=300)
    for o in out:
        assert o["unchanged"] and "checksum mismatch" in o["error"] and key in o["error"], o


def test_model_only_checkpoint_of_a_bf16_model_loads_its_planes_as_saved(ranks, tmp_path):
    """bf16 compute: the model weights are the main params rounded, so planes re-derived from them
    would differ; a model-only checkpoint (no fp32 main params) loads its planes as saved."""
    saved = joined(ranks(_train_and_save, 3, str(tmp_path / "ckpt"), "optim_grads_params", True, timeout=300))
    reshard(tmp_path / "ckpt", tmp_path / "model_only", world_size=3, model_only=True)
    loaded = joined(ranks(_load, 2, str(tmp_path / "model_only"), "optim_grads_params", True, False, timeout=300))
    differs = False
    for key in (k for k in saved if k.startswith("mx.")):
        assert torch.equal(loaded[key], saved[key]), key
    fqn = "decoder.layers.0.mlp.linear_fc1.weight"
    rounded = loaded[f"main.{fqn}"].view(256, 64)  # the bf16 weights, as fp32 main params now
    assert torch.equal(rounded, rounded.bfloat16().float())
    differs = not torch.equal(
        quantize(rounded, MXFormat(), "row")[0].reshape(-1).view(torch.uint8), saved[f"mx.{fqn}.rowwise_data"]
    )
    assert differs  # deriving from the rounded weights would not give the saved planes


@pytest.mark.heavy
@pytest.mark.parametrize("world", [2, 5])
def test_offline_reshard_cuts_planes_on_block_boundaries(ranks, tmp_path, world):
    """reshard 3 -> 2 and 5 ranks: each target rank's file holds its rows' planes, every plane
    chunk starts and ends on a 32-row block of its weight, and the online load at that size gives
    the same state bitwise."""
    saved = joined(ranks(_train_and_save, 3, str(tmp_path / "ckpt"), timeout=300))
    reshard(tmp_path / "ckpt", tmp_path / "out", world_size=world)
    with CheckpointReader(str(tmp_path / "out")) as reader:
        md = reader.metadata.state_dict_metadata
        for key in (k for k in md if k.startswith("mx.")):
            plane = key.rsplit(".", 1)[1]
            size = md[key].size
            rows_per_block = 1 if plane == "columnwise_scale" else 32
            for chunk in md[key].chunks:
                assert chunk.offsets[0] % rows_per_block == 0 and (
                    chunk.offsets[0] + chunk.sizes[0]
                ) % rows_per_block in (0, size[0] % rows_per_block), (key, chunk)
    files = sorted(f for f in os.listdir(tmp_path / "out") if f.endswith(".distcp"))
    assert len(files) == world
    loaded = joined(ranks(_load, world, str(tmp_path / "out"), timeout=300))
    for key in saved:
        assert torch.equal(loaded[key], saved[key]), key


def test_reshard_refuses_a_policy_that_splits_blocks(ranks, tmp_path):
    ranks(_train_and_save, 3, str(tmp_path / "ckpt"), timeout=300)
    result = CliRunner().invoke(
        cli, ["reshard", str(tmp_path / "ckpt"), str(tmp_path / "out"), "--world-size", "2", "--policy", "row"]
    )
    assert result.exit_code != 0 and result.output.count("\n") <= 2, result.output
    assert (
        "--policy row: parameter 'decoder.layers.0.self_attention.linear_qkv.weight': policy row can split its 32-row blocks"
        in result.output
    )
    assert not (tmp_path / "out").exists()


def test_inspect_lists_mx_tensors_with_format_and_rule(ranks, tmp_path):
    ranks(_train_and_save, 3, str(tmp_path / "ckpt"), timeout=300)
    text = CliRunner().invoke(cli, ["inspect", str(tmp_path / "ckpt")])
    assert text.exit_code == 0, text.output
    assert "mx          8 MXFP8 tensor(s), mxfp8 e4m3 floor, 32-element blocks" in text.output
    assert (
        "decoder.layers.0.mlp.linear_fc1.weight 256x64 mxfp8 e4m3 floor: columnwise_data, columnwise_scale, rowwise_data, rowwise_scale"
        in text.output
    )
    as_json = json.loads(CliRunner().invoke(cli, ["inspect", str(tmp_path / "ckpt"), "--json"]).output)
    assert {m["fqn"]: (m["element"], m["rule"]) for m in as_json["mx"]}["decoder.layers.1.mlp.linear_fc2.weight"] == (
        "e4m3",
        "floor",
    )
    assert os.path.isdir(tmp_path / "ckpt")
    shutil.rmtree(tmp_path / "ckpt")
