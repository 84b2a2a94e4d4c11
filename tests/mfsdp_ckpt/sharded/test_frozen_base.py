"""Frozen weights written once: a model with frozen parameters writes them into a base checkpoint of
the run and every save references it; readers follow the reference; retention keeps what is
referenced; a missing or changed base is refused in one line; a model without frozen parameters
writes what it always wrote."""

from __future__ import annotations

import json
import os

import fsspec
import pytest
import torch
import torch.distributed as dist

import mfsdp_ckpt
from mfsdp_ckpt.errors import CheckpointError
from mfsdp_ckpt.read.locate import open_checkpoint
from mfsdp_ckpt.tools.inspect import verify_checkpoint
from mfsdp_ckpt.tools.listing import list_checkpoints
from mfsdp_core import fully_shard_optimizer
from tests.harness import RankFailure, run_ranks
from tests.mfsdp_ckpt.util import owned_pieces
from tests.mfsdp_core.models import make_adamw, make_model, shard_model, train_steps
from tests.reliability.test_kill_during_save import _arm
from tests.s3 import use_endpoint

FROZEN = ("inp.", "block.fc1.", "norm")  # the input layer, one MLP matrix, every LayerNorm


def _build(seed: int = 0, frozen: bool = True, strategy: str = "optim_grads_params"):
    model = make_model("transformer", seed=seed)
    if frozen:
        for name, p in model.named_parameters():
            if any(f in name for f in FROZEN):
                p.requires_grad_(False)
    model = shard_model(model, strategy=strategy, policy="even")
    return model, fully_shard_optimizer(make_adamw([p for p in model.parameters() if p.requires_grad]))


def _manifest(path: str) -> dict:
    with open(os.path.join(path, "mfsdp.json")) as f:
        return json.load(f)


def _train_and_save(root: str, saves: int, keep: int | None = None, full: str | None = None) -> None:
    """``saves`` steps, each saved into ``root``; the last also in full (no base) to ``full``."""
    model, optim = _build()
    for s in range(saves):
        train_steps(model, optim, s, s + 1)
        mfsdp_ckpt.save(f"{root}/step_{s + 1:06d}", model, optim, step=s + 1, keep=keep)
    if full is not None:
        mfsdp_ckpt.save(full, model, optim, step=saves, frozen_once=False, update_latest=False)


def _loaded_differ(path: str, full: str, strategy: str) -> list[str]:
    """Load ``path`` (it references a base) and ``full`` (the same state written whole) into two
    fresh models of this layout: the keys whose owned pieces differ."""
    pieces = []
    for source in (path, full):
        model, optim = _build(seed=1, strategy=strategy)
        mfsdp_ckpt.load(source, model, optim)
        pieces.append(owned_pieces(model, optim))
    ours, theirs = pieces
    return [k for k in ours if not torch.equal(ours[k][2], theirs[k][2])]


def test_keep_two_over_six_saves_leaves_the_base_and_two_saves_that_load_elsewhere(tmp_path):
    root = str(tmp_path / "run")
    full = str(tmp_path / "full")
    run_ranks(_train_and_save, 2, root, 6, keep=2, full=full)
    names = sorted(n for n in os.listdir(root) if not n.startswith("."))
    assert names == ["base_step_000001", "latest", "latest-checkpoint", "step_000005", "step_000006"], names
    base = _manifest(f"{root}/base_step_000001")
    assert base["role"] == "base" and base["has_optimizer"] is False and base["include_grads"] is False
    keys = set(base["index"]["keys"])
    assert keys and all(k.startswith("model.") and any(f in k for f in FROZEN) for k in keys), keys
    for step in ("step_000005", "step_000006"):
        m = _manifest(f"{root}/{step}")
        assert m["base"]["name"] == "base_step_000001"
        assert not keys & set(m["index"]["keys"])  # the frozen weights are not written again
        assert verify_checkpoint(f"{root}/{step}") == []
    # loads at another world size and strategy (3 ranks: sizes that do not divide evenly)
    # exactly as the same state written whole does
    assert run_ranks(_loaded_differ, 3, root, full, "optim_grads") == [[], [], []]


def test_a_save_after_the_first_writes_only_what_trains(tmp_path):
    root = str(tmp_path / "run")
    run_ranks(_train_and_save, 2, root, 3)
    sizes = {
        n: sum(os.path.getsize(os.path.join(root, n, f)) for f in os.listdir(os.path.join(root, n)))
        for n in os.listdir(root)
        if os.path.isdir(os.path.join(root, n))
    }
    full = str(tmp_path / "full")
    run_ranks(_train_full, 2, full)
    whole = sum(os.path.getsize(os.path.join(full, f)) for f in os.listdir(full))
    # the base plus a save hold what one full save holds (within the second manifest and index)
    assert sizes["step_000002"] < whole
    assert abs(sizes["base_step_000001"] + sizes["step_000002"] - whole) < 0.25 * whole


def _train_full(path: str) -> None:
    model, optim = _build()
    train_steps(model, optim, 0, 1)
    mfsdp_ckpt.save(path, model, optim, step=1, frozen_once=False, update_latest=False)


def _save_dense(path: str) -> None:
    model, optim = _build(frozen=False)
    train_steps(model, optim, 0, 2)
    mfsdp_ckpt.save(path, model, optim, step=2)


def test_a_dense_run_writes_no_base_and_the_same_files(tmp_path):
    a, b = str(tmp_path / "a" / "step_000002"), str(tmp_path / "b" / "step_000002")
    run_ranks(_save_dense, 2, a)
    run_ranks(_save_dense, 2, b)
    assert sorted(os.listdir(tmp_path / "a")) == ["latest", "latest-checkpoint", "step_000002"]
    names = sorted(os.listdir(a))
    assert names == sorted(os.listdir(b))
    for n in names:  # the data files byte for byte; the manifests up to the save id and time
        if n.endswith(".distcp"):
            assert open(os.path.join(a, n), "rb").read() == open(os.path.join(b, n), "rb").read(), n
    ma, mb = _manifest(a), _manifest(b)
    assert "base" not in ma and "role" not in ma
    for m in (ma, mb):
        for field in ("save_id", "created_unix", "manifest_crc32c", "metadata_crc32c", "versions"):
            m.pop(field, None)
    assert ma == mb


@pytest.mark.parametrize("damage", ["deleted", "altered", "replaced", "linked"])
def test_a_missing_or_changed_base_is_refused_in_one_line(tmp_path, damage):
    root = str(tmp_path / "run")
    run_ranks(_train_and_save, 2, root, 2)
    base = f"{root}/base_step_000001"
    if damage == "deleted":
        import shutil

        shutil.rmtree(base)
    elif damage == "altered":  # every byte of one stored chunk flipped
        _, _, metadata, _ = open_checkpoint(base)
        _, info = next(iter(metadata.storage_data.items()))
        with open(os.path.join(base, info.relative_path), "r+b") as f:
            f.seek(info.offset)
            data = f.read(info.length)
            f.seek(info.offset)
            f.write(bytes(b ^ 0xFF for b in data))
    elif damage == "replaced":  # another save under the base's name
        import shutil

        shutil.rmtree(base)
        run_ranks(_train_full, 2, base)
        m = _manifest(base)
        m["role"] = "base"
        from mfsdp_ckpt.format.manifest import manifest_checksum

        m["manifest_crc32c"] = manifest_checksum(m)
        with open(os.path.join(base, "mfsdp.json"), "w") as f:
            json.dump(m, f)
    else:  # the base moved away and a link left in its place
        os.rename(base, str(tmp_path / "elsewhere"))
        os.symlink(str(tmp_path / "elsewhere"), base)
    step = f"{root}/step_000002"
    try:  # verify: refused outright, or one fault naming the base
        faults = verify_checkpoint(step)
        message = str(faults[0]) if faults else "no fault"
    except CheckpointError as e:
        message = str(e)
    assert "\n" not in message and "base_step_000001" in message, message
    with pytest.raises(RankFailure) as e:  # the rank's CheckpointError, reported by the harness
        run_ranks(_loaded_differ, 1, step, step, "optim_grads_params")
    assert "base_step_000001" in str(e.value)


# (function, before/after its call, which call, which rank dies): in the second save of a process,
# the one that references the base the first save wrote (each function's calls: the base's, the
# first save's, then the second save's)
KILLS = [
    ("mfsdp_ckpt.write.dcp_writer.CommittingWriter.write_data", "after", 3, 1),
    ("mfsdp_ckpt.write.dcp_writer.write_manifest", "after", 3, 0),
    ("mfsdp_ckpt.write.destination.commit_directory", "after", 3, 0),
    ("mfsdp_ckpt.write.run_dir.prune", "before", 2, 0),
    ("mfsdp_ckpt.storage.fs.shutil.rmtree", "after", 1, 0),
]


def _save_twice_killed(root: str, kill: tuple[str, str, int, int]) -> None:
    if dist.get_rank() == kill[3]:
        _arm(*kill[:3])
    model, optim = _build()
    for s in (1, 2):
        train_steps(model, optim, s - 1, s)
        mfsdp_ckpt.save(f"{root}/step_{s:06d}", model, optim, step=s, keep=1)


@pytest.mark.heavy
@pytest.mark.parametrize("target,when,nth,rank", KILLS, ids=[f"{k[0].rsplit('.', 1)[-1]}-{k[1]}{k[2]}" for k in KILLS])
def test_a_save_referencing_a_base_killed_loses_nothing_committed(tmp_path, target, when, nth, rank):
    root = str(tmp_path / "run")
    with pytest.raises(RankFailure) as failed:
        run_ranks(_save_twice_killed, 2, root, (target, when, nth, rank), timeout=120)
    assert f"rank {rank} of 2 exited with code -9 (SIGKILL)" in str(failed.value), failed.value
    latest = open(os.path.join(root, "latest")).read().strip()
    assert latest in ("step_000001", "step_000002")
    assert os.path.isdir(os.path.join(root, "base_step_000001"))
    committed = [e.name for e in list_checkpoints(root) if e.committed]
    assert latest in committed
    for name in committed:
        assert verify_checkpoint(os.path.join(root, name)) == [], name
    full = str(tmp_path / "full")
    run_ranks(_train_and_save, 2, str(tmp_path / "again"), int(latest[-1]), full=full)
    assert run_ranks(_loaded_differ, 3, os.path.join(root, "latest"), full, "optim_grads") == [[], [], []]


def _on_s3(url: str, endpoint: str, full: str) -> None:
    use_endpoint(endpoint)
    _train_and_save(url, 3, keep=1, full=full)


@pytest.mark.heavy
def test_bases_on_an_object_store(s3_endpoint, s3_bucket, tmp_path):
    """The same on S3: the base is a prefix beside the saves, followed by every reader, kept by
    the pruning while referenced."""
    url, full = f"{s3_bucket}/run", str(tmp_path / "full")
    run_ranks(_on_s3, 2, url, s3_endpoint, full, timeout=300)
    s3 = fsspec.filesystem("s3", skip_instance_cache=True)
    assert sorted(p.rsplit("/", 1)[-1] for p in s3.ls(url, detail=False)) == [
        "base_step_000001",
        "latest",
        "step_000003",
    ]
    assert verify_checkpoint(f"{url}/step_000003") == []
    assert run_ranks(_loaded_differ_s3, 3, f"{url}/latest", full, s3_endpoint, timeout=300) == [[], [], []]


def _loaded_differ_s3(path: str, full: str, endpoint: str) -> list[str]:
    use_endpoint(endpoint)
    return _loaded_differ(path, full, "optim_grads")


def _bases_after_three_saves(root: str, strategy: str) -> None:
    model, optim = _build(strategy=strategy)
    for s in range(3):
        train_steps(model, optim, s, s + 1)
        mfsdp_ckpt.save(f"{root}/step_{s + 1:06d}", model, optim, step=s + 1)


@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads"])
def test_every_strategy_writes_one_base_per_run(tmp_path, strategy):
    """Training between saves leaves the frozen tensors as they were under every strategy (the
    all-gathers and the optimizer step write elsewhere), so the base is written once."""
    root = str(tmp_path / "run")
    run_ranks(_bases_after_three_saves, 3, root, strategy)
    assert sorted(n for n in os.listdir(root) if n.startswith("base_")) == ["base_step_000001"]
    assert all(_manifest(f"{root}/step_{s:06d}")["base"]["name"] == "base_step_000001" for s in (1, 2, 3))
    assert verify_checkpoint(f"{root}/step_000003") == []
