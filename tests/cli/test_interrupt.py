"""Ctrl-C of ``mfsdp-ckpt``, as a terminal sends it (SIGINT to the whole process group, worker
processes included), is one line ``error: interrupted``, exit code 130, and leaves no destination:
while ``reshard --workers 2`` writes, and during start-up, before a command's error boundary."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.torchrun import start_in_own_session

ROOT = Path(__file__).resolve().parent.parent.parent
# start-up: on the first import of torch (while click parses or a command imports what it needs),
# the process sends itself SIGINT, as if Ctrl-C came then; deterministic, unlike a timed signal
INTERRUPT_ON_TORCH = textwrap.dedent(
    """
    import os, signal, sys

    class _InterruptOnTorch:
        def find_spec(self, name, path=None, target=None):
            if name == "torch":
                sys.meta_path.remove(self)
                os.kill(os.getpid(), signal.SIGINT)
            return None

    sys.meta_path.insert(0, _InterruptOnTorch())
    """
)


def _spawn(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """``mfsdp-ckpt ARGS`` in a process group of its own (so a signal to the group reaches it and
    its workers, and nothing else)."""
    return start_in_own_session([sys.executable, "-m", "cli.main", *args], ROOT, env)


@pytest.fixture(scope="module")
def big_ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A single-process checkpoint of 16 linear layers of 1024x1024 float32 (64 MiB, in 16
    tensors, so that workers have several files to write)."""
    import torch
    from torch import nn

    import mfsdp_ckpt
    from mfsdp_core import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1024, 1024, bias=False) for _ in range(16)])
    fully_shard(model)
    path = tmp_path_factory.mktemp("big") / "step-1"
    mfsdp_ckpt.save(path, model, step=1)
    return str(path)


def _writing(out: Path) -> bool:
    """Whether a staging directory under ``out`` already holds written bytes."""
    for d in out.iterdir():
        if d.is_dir():
            for f in d.iterdir():
                if f.is_file() and f.stat().st_size > 0:
                    return True
    return False


def _assert_interrupted(proc: subprocess.Popen) -> None:
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert err.splitlines() == ["error: interrupted"], err


def test_ctrl_c_during_a_reshard_with_workers(big_ckpt: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    dst = out / "w3"
    proc = _spawn("reshard", big_ckpt, str(dst), "--world-size", "3", "--workers", "2")
    deadline = time.monotonic() + 120
    while not _writing(out):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the reshard never started writing"
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGINT)
    _assert_interrupted(proc)
    assert not dst.exists()
    left = [p.name for p in out.iterdir() if p.is_dir()]
    assert left == [], left  # no staging directory either


def test_ctrl_c_during_start_up(tmp_path: Path) -> None:
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(INTERRUPT_ON_TORCH)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(hook), str(ROOT)]))
    # a source that is there: a missing one is refused before torch is imported (no interrupt then)
    proc = _spawn("reshard", str(hook), str(tmp_path / "dst"), "--world-size", "3", env=env)
    _assert_interrupted(proc)
    assert not (tmp_path / "dst").exists()
