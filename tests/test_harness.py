"""Tests for tests/harness.py: real gloo process groups, real failures, no leaked processes.

Rank functions are module-level on purpose: children import them by reference.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests import harness
from tests.harness import RankFailure, run_ranks


@pytest.fixture(autouse=True)
def _no_leaked_children():
    """Every run_ranks call, passing or failing, must leave no child process behind."""
    yield
    assert multiprocessing.active_children() == []


def _pids(pid_dir: Path) -> list[int]:
    """Pids the ranks wrote (a rank killed before getting that far wrote none)."""
    return [int(p.read_text()) for p in sorted(pid_dir.glob("pid*"))]


def _interrupt_when_started(pid_dir: Path, world_size: int) -> None:
    """Send a real SIGINT to the main thread (as Ctrl-C would) once all ranks are running."""
    end = time.monotonic() + 60
    while len(_pids(pid_dir)) < world_size and time.monotonic() < end:
        time.sleep(0.1)
    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


# --- rank functions (module level) -----------------------------------------------------------


def _whoami(tag: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    time.sleep(0.2 * (world - 1 - rank))  # finish in reverse rank order
    env = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    return {
        "rank": rank,
        "world": world,
        "env": env,
        "tag": tag,
        "threads": torch.get_num_threads(),
        "backend": dist.get_backend(),
    }


def _all_reduce_sum(n: int) -> torch.Tensor:
    t = torch.arange(n, dtype=torch.float64) + dist.get_rank()
    dist.all_reduce(t)
    return t


def _raise_on_rank_one() -> int:
    if dist.get_rank() == 1:
        raise ValueError("boom on rank one")
    dist.barrier()
    return dist.get_rank()


def _announce(pid_dir: str) -> None:
    """Write this rank's pid file whole: written under another name, then renamed, so that a
    reader polling the directory never reads a file that is created but still empty."""
    part = Path(pid_dir, f".part{dist.get_rank()}")
    part.write_text(str(os.getpid()))
    os.replace(part, Path(pid_dir, f"pid{dist.get_rank()}"))


def _hang(pid_dir: str) -> None:
    _announce(pid_dir)
    if dist.get_rank() == 0:
        dist.barrier()  # waits for rank 1, which never comes
    else:
        while True:
            time.sleep(60)


def _sleep_forever(pid_dir: str) -> None:
    _announce(pid_dir)
    while True:
        time.sleep(60)


def _die_on_rank_two(how: str) -> int:
    dist.barrier()  # everyone connected
    if dist.get_rank() == 2:
        if how == "exit":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGSEGV)
        time.sleep(60)
    dist.barrier()  # peers are mid-collective when rank 2 dies: they fail too, as a consequence
    return dist.get_rank()


def _tensors(scale: torch.Tensor) -> dict:
    gen = torch.Generator().manual_seed(1234 + dist.get_rank())
    return {
        "randn": torch.randn(257, 3, generator=gen, dtype=torch.float64),
        "bf16": torch.randn(17, generator=gen).to(torch.bfloat16),
        "scaled": scale * dist.get_rank(),
    }


# --- tests -----------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 3, 5])
def test_results_in_rank_order(ranks, world_size):
    out = ranks(_whoami, world_size, "tag")
    assert [o["rank"] for o in out] == list(range(world_size))
    port = out[0]["env"]["MASTER_PORT"]
    for rank, o in enumerate(out):
        assert o["world"] == world_size and o["tag"] == "tag" and o["backend"] == "gloo"
        assert o["threads"] == 1
        assert o["env"] == {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
        }


def test_all_reduce_sums_across_ranks(ranks):
    out = ranks(_all_reduce_sum, 3, 5)
    expected = 3 * torch.arange(5, dtype=torch.float64) + (0 + 1 + 2)
    assert len(out) == 3
    for t in out:
        assert torch.equal(t, expected)


def test_exception_on_one_rank_surfaces(ranks):
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        ranks(_raise_on_rank_one, 3)
    message = str(info.value)
    assert message.splitlines()[0] == "rank 1 of 3 failed: ValueError: boom on rank one"
    assert "Traceback" in message and "_raise_on_rank_one" in message
    assert 1 in info.value.ranks
    assert time.monotonic() - start < 60


@pytest.mark.heavy
def test_hanging_rank_is_killed(tmp_path):
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_ranks(_hang, 2, str(tmp_path), timeout=5)
    elapsed = time.monotonic() - start
    assert elapsed < 60, elapsed
    assert "rank 1" in str(info.value) and 1 in info.value.ranks
    pids = _pids(tmp_path)
    assert multiprocessing.active_children() == []
    assert all(_gone(pid) for pid in pids), pids


def test_timeout_names_silent_ranks(tmp_path, monkeypatch):
    monkeypatch.setattr(harness, "STARTUP_SLACK_S", 2.0)
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_ranks(_sleep_forever, 2, str(tmp_path), timeout=2)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert message.startswith("timed out after 2s")
    assert "rank(s) 0, 1 of 2 never reported" in message
    assert info.value.ranks == [0, 1]
    assert 4 <= elapsed < 30, elapsed
    pids = _pids(tmp_path)
    assert all(_gone(pid) for pid in pids), pids


def test_keyboard_interrupt_kills_all_ranks(tmp_path):
    timer = threading.Thread(target=_interrupt_when_started, args=(tmp_path, 2), daemon=True)
    start = time.monotonic()
    # Python's own Ctrl-C handler even where the suite inherited SIGINT ignored (started in the
    # background by a non-interactive shell, as `cmd &` in a script does)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            timer.start()
            run_ranks(_sleep_forever, 2, str(tmp_path), timeout=60)
        timer.join()
    finally:
        signal.signal(signal.SIGINT, previous)
    assert time.monotonic() - start < 50
    pids = _pids(tmp_path)
    assert len(pids) == 2
    assert multiprocessing.active_children() == []
    assert all(_gone(pid) for pid in pids), pids


@pytest.mark.parametrize(
    ("how", "code"), [("exit", "code 3 "), ("segv", "code -11 (SIGSEGV)")], ids=["os_exit", "segfault"]
)
def test_rank_dying_without_report(ranks, how, code):
    with pytest.raises(RankFailure) as info:
        ranks(_die_on_rank_two, 3, how)
    first = str(info.value).splitlines()[0]  # the death, not the peers' connection errors
    assert first.startswith("rank 2 of 3 exited with") and code in first + " "
    assert first.endswith("without reporting")
    assert 2 in info.value.ranks


def test_tensors_travel_exactly(ranks):
    scale = torch.linspace(-1, 1, 11, dtype=torch.float64)
    out = ranks(_tensors, 2, scale)
    for rank, got in enumerate(out):
        gen = torch.Generator().manual_seed(1234 + rank)
        assert torch.equal(got["randn"], torch.randn(257, 3, generator=gen, dtype=torch.float64))
        assert torch.equal(got["bf16"], torch.randn(17, generator=gen).to(torch.bfloat16))
        assert torch.equal(got["scaled"], scale * rank)


def test_unpicklable_fn_is_rejected_up_front():
    with pytest.raises(TypeError, match="module-level"):
        run_ranks(lambda: 0, 2)


def _write_module(directory: Path, name: str) -> None:
    (directory / f"{name}.py").write_text(
        textwrap.dedent("""
        import torch.distributed as dist

        def rank_fn():
            return ("from", __name__, dist.get_rank())
    """)
    )


def test_child_sees_parent_sys_path(tmp_path, monkeypatch):
    _write_module(tmp_path, "harness_probe_mod")
    monkeypatch.syspath_prepend(str(tmp_path))
    import harness_probe_mod

    assert run_ranks(harness_probe_mod.rank_fn, 2) == [("from", "harness_probe_mod", r) for r in range(2)]


def test_child_import_error_is_reported(tmp_path, monkeypatch):
    _write_module(tmp_path, "harness_unreachable_mod")
    monkeypatch.syspath_prepend(str(tmp_path))
    import harness_unreachable_mod

    sys.path.remove(str(tmp_path))  # the parent can pickle it, the child cannot import it
    with pytest.raises(RankFailure) as info:
        run_ranks(harness_unreachable_mod.rank_fn, 1)
    assert str(info.value).startswith(
        "rank 0 of 1 failed: ModuleNotFoundError: No module named 'harness_unreachable_mod'"
    )


def _missing_preloads() -> list[str]:
    return [name for name in harness.PRELOAD if name not in sys.modules]


def test_ranks_start_with_the_preloaded_modules(ranks):
    """The forkserver ignores a preload that fails to import, and each rank would then pay for
    it again (``torch._dynamo``: over a second per rank); neither this module nor the harness
    imports these modules, so a rank has them only from the forkserver."""
    assert ranks(_missing_preloads, 2) == [[], []]
