"""A valid checkpoint is read under an address-space cap of its size + 1 GiB (``ulimit -v``, strict
overcommit, a container's memory cap): readers read what a file holds, in bounded pieces, rather
than reserving their bound up front (a manifest's 1 GiB bound was once read with one
``f.read(bound + 1)``, which reserved 1 GiB for a file of a few KB and failed with MemoryError)."""

from __future__ import annotations

import os
import resource
import subprocess
import textwrap

import pytest

from tests.reliability.test_hostile_support import run_capped

GIB = 1 << 30

_LOAD = textwrap.dedent(
    """
    import sys, warnings, torch, mfsdp_ckpt
    from tests.mfsdp_ckpt.util import build, owned_pieces
    from tests.reliability.test_hostile_support import trained_mlp
    saved = owned_pieces(*trained_mlp())  # what the fixture saved, computed as it was (same threads)
    model, optim = build("optim_grads_params", "even", seed=7, name="mlp")  # other weights, no optimizer state
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mfsdp_ckpt.load(sys.argv[1], model, optim)
    got = owned_pieces(model, optim)
    assert sorted(got) == sorted(saved), (sorted(got), sorted(saved))
    assert all(torch.equal(got[k][2], saved[k][2]) for k in saved)
    print("loaded")
    """
)


def _size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _capped(cap: int, *args: str) -> subprocess.CompletedProcess:
    return run_capped(list(args), cap, env={**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    """The test MLP's checkpoint, saved by a process of the environment the capped ones run in (one
    thread: its values are those the load case recomputes)."""
    path = str(tmp_path_factory.mktemp("capped") / "ckpt")
    save = (
        "import sys; from tests.reliability.test_hostile_support import save_small as s; s(sys.argv[1], listed=False)"
    )
    out = _capped(resource.RLIM_INFINITY, "-c", save, path)
    assert out.returncode == 0, out.stderr[-2000:]
    return path


@pytest.mark.parametrize(
    "command, expect",
    [(["-m", "cli.main", "verify"], "ok: "), (["-m", "cli.main", "inspect"], "step"), (["-c", _LOAD], "loaded")],
    ids=["verify", "inspect", "load"],
)
def test_a_valid_checkpoint_is_read_under_its_size_plus_1_gib_of_address_space(
    checkpoint: str, command: list[str], expect: str
) -> None:
    out = _capped(_size(checkpoint) + GIB, *command, checkpoint)
    assert out.returncode == 0, out.stderr[-2000:]
    assert expect in out.stdout, out.stdout[-2000:]
