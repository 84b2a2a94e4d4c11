"""``save`` / ``load`` on ``s3://`` during training, against a real local S3 server (moto on
127.0.0.1, through s3fs): the same canonical checkpoint as a local save (``diff`` equal, verified),
``latest`` as an object, ``keep`` pruning whole prefixes, overwrite un-committing first, loads at
another world size; and through a seeded fault-injecting proxy (dropped connections, lost answers,
503 SlowDown, cut responses, delays): every save ends committed and exact, or in one clean line
with nothing committed; loads of committed checkpoints return the exact state."""

from __future__ import annotations

import os

import fsspec
import pytest
import torch

import mfsdp_ckpt
from mfsdp_ckpt.tools.diff import diff_checkpoints
from mfsdp_ckpt.tools.inspect import verify_checkpoint
from mfsdp_ckpt.tools.listing import clean_run_dir
from tests.harness import RankFailure, run_ranks
from tests.mfsdp_ckpt.util import build, owned_pieces, train_steps
from tests.s3 import Faults, use_endpoint


def _s3() -> fsspec.AbstractFileSystem:
    return fsspec.filesystem("s3", skip_instance_cache=True)


def _save_both(local: str, url: str, endpoint: str) -> dict:
    """Train 2 steps, save the same state locally and on S3 (three times on S3, keep=2), and
    return this rank's owned pieces."""
    use_endpoint(endpoint)
    model, optim = build("optim_grads_params", "row")
    train_steps(model, optim, 0, 2)
    mfsdp_ckpt.save(os.path.join(local, "step_2"), model, optim, extra={"step": 2}, step=2)
    for name in ("step_0", "step_1", "step_2"):  # keep=2: step_0 is pruned
        mfsdp_ckpt.save(f"{url}/{name}", model, optim, extra={"step": 2}, step=2, keep=2)
    # the trainer's overwrite of a committed checkpoint
    mfsdp_ckpt.save(f"{url}/step_2", model, optim, extra={"step": 2}, step=2, keep=2, overwrite=True)
    with pytest.raises(mfsdp_ckpt.CheckpointError, match="already exists"):
        mfsdp_ckpt.save(f"{url}/step_2", model, optim)
    return owned_pieces(model, optim)


def _load(path: str, endpoint: str) -> tuple[dict, dict]:
    use_endpoint(endpoint)
    model, optim = build("optim_grads_params", "row", seed=123)  # other weights: the load replaces them
    extra = mfsdp_ckpt.load(path, model, optim)
    return extra, owned_pieces(model, optim)


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k][:2] == b[k][:2] and torch.equal(a[k][2], b[k][2]) for k in a)


@pytest.mark.heavy
def test_save_and_load_on_s3_equal_a_local_save(s3_endpoint, s3_bucket, tmp_path):
    local, url = str(tmp_path / "run"), f"{s3_bucket}/run"
    saved = run_ranks(_save_both, 2, local, url, s3_endpoint, timeout=300)
    s3 = _s3()
    names = sorted(p.rsplit("/", 1)[-1] for p in s3.ls(url, detail=False))
    assert names == ["latest", "step_1", "step_2"], names  # keep=2 removed step_0's whole prefix
    assert s3.cat(f"{url}/latest") == b"step_2\n"
    assert sorted(p.rsplit("/", 1)[-1] for p in s3.ls(f"{url}/step_2", detail=False)) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "mfsdp.json",
    ]
    assert verify_checkpoint(f"{url}/step_2") == []
    assert diff_checkpoints(os.path.join(local, "step_2"), f"{url}/step_2").equal
    # load from S3 (via ``latest``) at the same world size: the state as saved
    loaded = run_ranks(_load, 2, url, s3_endpoint, timeout=300)
    assert all(extra == {"step": 2} for extra, _ in loaded)
    assert all(_same(pieces, mine) for (_, pieces), mine in zip(loaded, saved))
    # at 3 ranks: the same as a load of the local checkpoint at 3 ranks
    from_s3 = run_ranks(_load, 3, f"{url}/step_2", s3_endpoint, timeout=300)
    from_local = run_ranks(_load, 3, os.path.join(local, "step_2"), s3_endpoint, timeout=300)
    assert all(_same(a, b) for (_, a), (_, b) in zip(from_s3, from_local))


@pytest.mark.heavy
def test_uncommitted_prefix_is_refused_and_cleaned_by_the_next_save(s3_endpoint, s3_bucket, tmp_path):
    url = f"{s3_bucket}/run"
    run_ranks(_save_both, 1, str(tmp_path / "run"), url, s3_endpoint, timeout=300)
    s3 = _s3()
    # as an interrupted save or overwrite leaves it: data files and .metadata, no manifest
    s3.rm(f"{url}/step_1/mfsdp.json")
    with pytest.raises(
        RankFailure, match=r"UncommittedCheckpointError: .*step_1: no committed manifest \(mfsdp.json\)"
    ):
        run_ranks(_load, 1, f"{url}/step_1", s3_endpoint, timeout=300)
    before = _load_failure_is_harmless(url, s3_endpoint)
    assert before
    run_ranks(_save_one, 1, f"{url}/step_3", s3_endpoint, timeout=300)
    assert not s3.exists(f"{url}/step_1")  # removed by the next save
    assert s3.cat(f"{url}/latest") == b"step_3\n"
    # and by ``mfsdp-ckpt ls --clean``, which leaves what a save does not write alone
    s3.rm(f"{url}/step_2/mfsdp.json")
    s3.pipe(f"{url}/notes/readme.txt", b"mine")
    assert clean_run_dir(url) == [f"{url}/step_2"]
    assert (
        not s3.exists(f"{url}/step_2")
        and s3.exists(f"{url}/notes/readme.txt")
        and s3.exists(f"{url}/step_3/mfsdp.json")
    )


def _load_failure_is_harmless(url: str, endpoint: str) -> bool:
    """A failed load changes nothing: the model keeps its weights."""
    return run_ranks(_failed_load_keeps_state, 1, f"{url}/step_1", endpoint, timeout=300)[0]


def _failed_load_keeps_state(path: str, endpoint: str) -> bool:
    use_endpoint(endpoint)
    model, optim = build("optim_grads_params", "row", seed=7)
    before = owned_pieces(model, optim)
    try:
        mfsdp_ckpt.load(path, model, optim)
    except mfsdp_ckpt.CheckpointError:
        pass
    return _same(before, owned_pieces(model, optim))


def _save_one(path: str, endpoint: str) -> None:
    use_endpoint(endpoint)
    model, optim = build("optim_grads_params", "row")
    mfsdp_ckpt.save(path, model, optim, extra={"step": 3}, step=3)


# ---- through the fault-injecting proxy -------------------------------------------------------------


def _saves_through_proxy(url: str, proxy: str, attempts: int, n: int) -> list[str | None]:
    """``n`` saves through the proxy: None for a save that returned, else its error's text."""
    from mfsdp_ckpt.storage import remote

    use_endpoint(proxy)
    assert hasattr(remote, "ATTEMPTS") and hasattr(remote, "BACKOFF_S")  # a moved setting fails here, not unused
    remote.ATTEMPTS = attempts
    remote.BACKOFF_S = 0.05
    model, optim = build("optim_grads_params", "row")
    train_steps(model, optim, 0, 1)
    out: list[str | None] = []
    for i in range(n):
        try:
            mfsdp_ckpt.save(f"{url}/step_{i}", model, optim, extra={"step": 0}, step=0)  # the reference's state
            out.append(None)
        except mfsdp_ckpt.CheckpointError as e:
            out.append(str(e))
    return out


def _client_retries(total: int) -> None:
    """Bound the client's own retries (so that a test of final failure ends quickly)."""
    import fsspec.config

    conf = fsspec.config.conf.setdefault("s3", {})
    conf["config_kwargs"] = {"retries": {"max_attempts": total, "mode": "standard"}}


def _saves_with_bounded_retries(url: str, proxy: str) -> list[str | None]:
    _client_retries(2)
    return _saves_through_proxy(url, proxy, 2, 1)


@pytest.mark.heavy
def test_saves_and_loads_through_a_faulty_proxy(s3_endpoint, s3_bucket, s3_proxy, tmp_path):
    s3 = _s3()
    url = f"{s3_bucket}/faulty"
    # a reference of the saved state, saved directly
    run_ranks(_save_one_trained, 2, f"{s3_bucket}/reference", s3_endpoint, timeout=300)
    s3_proxy.faults = Faults(seed=1, drop=0.04, lost=0.04, slowdown=0.08, cut=0.04, delay=0.1)
    results = run_ranks(_saves_through_proxy, 2, url, s3_proxy.url, 4, 4, timeout=600)
    counts = dict(s3_proxy.faults.counts)
    assert sum(counts[k] for k in Faults.KINDS) > 10, counts  # faults really happened
    assert results[0] == results[1]
    for i, err in enumerate(results[0]):
        prefix = f"{url}/step_{i}"
        committed = s3.exists(f"{prefix}/mfsdp.json")
        if err is None:
            assert committed, prefix
        else:
            assert "\n" not in err and not committed, err
        if committed:  # never a committed partial checkpoint
            assert verify_checkpoint(prefix) == []
            assert diff_checkpoints(prefix, f"{s3_bucket}/reference").equal
    assert results[0].count(None) >= 2, results[0]
    # loads of committed checkpoints through the proxy: the exact state
    s3_proxy.faults = Faults(seed=2, drop=0.05, lost=0.05, slowdown=0.1, cut=0.1, delay=0.1)
    good = next(i for i, err in enumerate(results[0]) if err is None)
    through = run_ranks(_load_with_faults, 2, f"{url}/step_{good}", s3_proxy.url, timeout=600)
    s3_proxy.faults = Faults()
    direct = run_ranks(_load, 2, f"{s3_bucket}/reference", s3_endpoint, timeout=300)
    assert all(_same(a, b) for (_, a), (_, b) in zip(through, direct))


def _save_one_trained(path: str, endpoint: str) -> None:
    use_endpoint(endpoint)
    model, optim = build("optim_grads_params", "row")
    train_steps(model, optim, 0, 1)
    mfsdp_ckpt.save(path, model, optim, extra={"step": 0}, step=0)


def _load_with_faults(path: str, proxy: str) -> tuple[dict, dict]:
    extra, pieces = _load(path, proxy)
    return {k: v for k, v in extra.items() if k != "step"}, pieces


@pytest.mark.heavy
def test_a_save_that_cannot_upload_fails_in_one_line_and_commits_nothing(s3_endpoint, s3_bucket, s3_proxy):
    s3 = _s3()
    url = f"{s3_bucket}/broken"
    s3_proxy.faults = Faults(seed=3, methods=("PUT", "POST"), drop=1.0)
    [errors] = run_ranks(_saves_with_bounded_retries, 1, url, s3_proxy.url, timeout=600)
    [err] = errors
    assert err is not None and "\n" not in err, err
    assert "upload failed after 2 attempts" in err and f"{url}/step_0/" in err, err
    assert not s3.exists(f"{url}/step_0/mfsdp.json")
    assert not s3.exists(f"{url}/latest")
    # the credentials never appear in what the user sees
    assert "testing" not in err


def test_manifest_is_the_last_object_written(s3_endpoint, s3_bucket, s3_proxy):
    """Recorded through the proxy: every upload under the prefix precedes the manifest's, and
    ``latest`` follows it."""
    run_ranks(_save_one, 2, f"{s3_bucket}/ordered/step_1", s3_proxy.url, timeout=300)
    bucket = s3_bucket[len("s3://") :]
    writes = [
        path
        for method, path, status in s3_proxy.log
        if method in ("PUT", "POST") and status < 300 and path.startswith(f"/{bucket}/ordered/")
    ]
    names = [w.rsplit("/", 1)[-1] for w in writes]
    assert names.count("mfsdp.json") == 1 and names[-2:] == ["mfsdp.json", "latest"], names
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(names[:-2]), names
