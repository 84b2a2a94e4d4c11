"""``mfsdp_ckpt.hf.export`` inside a job on real gloo ranks: the ranks write disjoint shard files
(file i by rank i % world), rank 0 the index and config; the result is byte-for-byte the
single-process export. A failure on one rank leaves nothing at the destination on any rank."""

from __future__ import annotations

import os

import torch.distributed as dist

from mfsdp_ckpt import hf
from mfsdp_ckpt.errors import CheckpointError
from mfsdp_ckpt.write.builder import CheckpointBuilder
from mfsdp_core.models.gpt import PRESETS, GPTModel


def _checkpoint(path: str) -> str:
    import torch

    torch.manual_seed(0)
    config = PRESETS["mixtral-like-small"]
    manifest = {
        "writer": {"world_size": 1, "buffers": [], "groups": []},
        "model_config": config.to_dict(),
        "step": None,
        "include_grads": False,
        "has_optimizer": False,
        "versions": {},
    }
    with CheckpointBuilder(path, manifest) as b:
        for k, v in GPTModel(config).named_parameters():
            b.add_tensor(f"model.{k}", v.detach())
        b.commit()
    return path


def _export_on_ranks(ckpt: str, out: str) -> dict:
    written = []

    def progress(done: int, total: int) -> None:
        written.append(done)

    result = hf.export(ckpt, out, max_shard_size="1MB", progress=progress)
    return {"files": result.files, "bytes_mine": written[-1] if written else 0, "rank": dist.get_rank()}


def _fail_on_rank_1(done: int, total: int) -> None:
    if dist.get_rank() == 1:
        raise RuntimeError("disk full on rank 1")


def _export_failing(ckpt: str, out: str) -> str:
    try:
        hf.export(ckpt, out, max_shard_size="1MB", progress=_fail_on_rank_1)
    except RuntimeError as e:
        return f"RuntimeError: {e}"
    except CheckpointError as e:
        return f"CheckpointError: {e}"
    return "no error"


def test_three_ranks_write_the_same_files_as_one_process(ranks, tmp_path):
    ckpt = _checkpoint(str(tmp_path / "ckpt"))
    single = hf.export(ckpt, tmp_path / "single", max_shard_size="1MB")
    assert len(single.files) >= 5
    results = ranks(_export_on_ranks, 3, ckpt, str(tmp_path / "multi"), timeout=120)
    assert all(r["files"] == single.files for r in results)
    assert all(r["bytes_mine"] > 0 for r in results)  # every rank wrote shards
    for name in single.files + ["model.safetensors.index.json", "config.json"]:
        a = (tmp_path / "single" / name).read_bytes()
        b = (tmp_path / "multi" / name).read_bytes()
        assert a == b, name


def test_a_failing_rank_leaves_nothing(ranks, tmp_path):
    ckpt = _checkpoint(str(tmp_path / "ckpt"))
    results = ranks(_export_failing, 3, ckpt, str(tmp_path / "out"), timeout=120)
    assert results[1] == "RuntimeError: disk full on rank 1"
    assert results[0].startswith("CheckpointError: ") and "rank 1 failed" in results[0]
    assert results[2].startswith("CheckpointError: ") and "rank 1 failed" in results[2]
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
