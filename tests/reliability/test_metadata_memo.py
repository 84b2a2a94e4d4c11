"""A ``.metadata`` pickle cannot make the unpickler allocate more than its own size (issue 66,
item 5: the hostile-fuzz flake).

CPython's C unpickler grows its memo array to twice any index a ``PUT`` / ``BINPUT`` /
``LONG_BINPUT`` names and clears it slot by slot: one flipped bit turning a ``BUILD`` (``b``)
into a ``LONG_BINPUT`` (``r``) makes the next four bytes an index, and a ten-byte file of index
2**28 cost 4 GiB and 24 s before anything was refused (2**30: 16 GiB, 80 s). The fuzz's 10-s
deadline fired inside ``inspect`` when a flip did that (which flip does depends on the base
checkpoint's bytes, whose ``save_id`` and path differ per run: a flake). Now a scan of the
opcodes refuses a memo index at or past the pickle's length, before unpickling.

No timing here: the tests count bytes (``tracemalloc``), run the large indices under an
address-space cap (a regression fails with MemoryError, fast, rather than swapping), and check
the scan against pickletools' own reading of every one-bit flip of a metadata pickle."""

from __future__ import annotations

import json
import os
import pickle
import pickletools
import textwrap
import tracemalloc
import warnings

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from mfsdp_ckpt.errors import UnsafeCheckpointError
from mfsdp_ckpt.format.safety import memo_problem, safe_load_metadata
from tests.reliability.test_hostile_support import run_capped, save_small

pytestmark = pytest.mark.timeout(300)


def _long_binput(index: int) -> bytes:
    """Protocol 4: push None, store it at memo ``index`` (LONG_BINPUT), stop. Ten bytes."""
    return b"\x80\x04N" + b"r" + index.to_bytes(4, "little") + b"."


HOSTILE = {
    "LONG_BINPUT 2**28": _long_binput(2**28),  # was: 4 GiB, 24 s
    "LONG_BINPUT 2**30": _long_binput(2**30),  # was: 16 GiB, 80 s
    "LONG_BINPUT 2**32-1": _long_binput(2**32 - 1),
    "PUT 10**8 (protocol 0)": b"Np100000000\n.",  # was: 1.5 GiB, 3 s
    "PUT 10**15 (protocol 0)": b"Np1000000000000000\n.",
    "BINPUT 200 in 6 bytes": b"\x80\x02Nq\xc8.",
}


@pytest.fixture(scope="module")
def metadata(tmp_path_factory):
    """A real ``.metadata`` (the test MLP's) as DCP pickled it, and the object."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ckpt = save_small(str(tmp_path_factory.mktemp("memo") / "run" / "step_1"))
    with open(os.path.join(ckpt, ".metadata"), "rb") as f:
        data = f.read()
    return data, pickle.loads(data)  # our own file


def test_a_memo_index_past_the_end_is_refused_before_unpickling():
    """One line naming the index and the pickle's size; under a 2-GiB address-space cap, so that
    unpickling any of them as before fails with MemoryError instead of taking the machine."""
    script = textwrap.dedent(
        """
        import json, sys
        from mfsdp_ckpt.format.safety import safe_load_metadata
        out = {}
        for name, hexdata in json.loads(sys.stdin.read()).items():
            try:
                safe_load_metadata(bytes.fromhex(hexdata), "x/.metadata")
                out[name] = "loaded"
            except Exception as e:
                out[name] = f"{type(e).__name__}: {e}"
        print(json.dumps(out))
        """
    )
    proc = run_capped(["-c", script], 2 << 30, input=json.dumps({k: v.hex() for k, v in HOSTILE.items()}))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, data in HOSTILE.items():
        message = out[name]
        assert message.startswith("UnsafeCheckpointError: x/.metadata: unreadable metadata (memo index "), (
            name,
            message,
        )
        assert f"past the end of a {len(data)}-byte pickle" in message and "\n" not in message, (name, message)


def test_refusing_allocates_nothing_of_the_index():
    """Counted, not timed: the refusal's peak allocation is a few KiB, whatever the index (the
    C unpickler used to reserve 16 bytes per index: 64 MiB for this one)."""
    tracemalloc.start()
    try:
        with pytest.raises(UnsafeCheckpointError, match=r"memo index 4194304 at byte 3"):
            safe_load_metadata(_long_binput(2**22), "x/.metadata")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 << 10, peak


def test_a_put_that_is_not_a_number_is_refused():
    with pytest.raises(UnsafeCheckpointError, match=r"unreadable metadata \(PUT at byte 1: not a memo index\)"):
        safe_load_metadata(b"Npx1\n.", "x/.metadata")


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_sound_pickles_of_every_protocol_pass_the_scan(metadata, protocol):
    """Protocols 0-3 store the memo with PUT / BINPUT / LONG_BINPUT (4 and 5 with MEMOIZE): the
    scan passes a sound pickle of each, which loads as before (0 and 1 rebuild objects through
    ``copyreg._reconstructor``, which the allow-list refuses, as it did)."""
    data, md = metadata
    again = pickle.dumps(md, protocol=protocol)
    assert memo_problem(again) is None
    assert memo_problem(data) is None
    if protocol < 2:
        with pytest.raises(UnsafeCheckpointError, match=r"refusing to load 'copy_reg._reconstructor'"):
            safe_load_metadata(again, "x/.metadata")
        return
    loaded = safe_load_metadata(again, "x/.metadata")
    assert loaded.state_dict_metadata == md.state_dict_metadata
    assert loaded.storage_data == md.storage_data


def _memo_stores_past_the_end(data: bytes) -> list[int]:
    """The memo indices at or past the end that pickletools' own reader sees before it stops (at
    STOP or the first byte it cannot read)."""
    found = []
    try:
        for op, arg, _ in pickletools.genops(data):
            if op.name in ("PUT", "BINPUT", "LONG_BINPUT") and isinstance(arg, int) and arg >= len(data):
                found.append(arg)
    except Exception:  # noqa: BLE001 - a flipped byte stops it somewhere; what it saw before counts
        pass
    return found


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # pickletools on a flipped protocol-0 string
@pytest.mark.parametrize("protocol", [0, 2, 4])
def test_the_scan_sees_every_memo_store_past_the_end_in_every_one_bit_flip(protocol):
    """Every one-bit flip of a small metadata pickle: where pickletools reads a memo store past
    the end (before the pickle ends or stops making sense), the scan refuses the bytes. (The scan
    may refuse more: it does not check the strings it steps over, which the unpickler would refuse
    anyway.)"""
    chunks = [
        ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 3])),
        ChunkStorageMetadata(torch.Size([2, 0]), torch.Size([2, 3])),
    ]
    md = Metadata(
        {"model.w": TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([4, 3]), chunks)},
        storage_data={MetadataIndex("model.w", c.offsets): None for c in chunks},
    )
    data = pickle.dumps(md, protocol=protocol)
    flips = 0
    for pos in range(len(data)):
        for bit in range(8):
            flipped = data[:pos] + bytes([data[pos] ^ (1 << bit)]) + data[pos + 1 :]
            if _memo_stores_past_the_end(flipped):
                flips += 1
                problem = memo_problem(flipped)
                assert problem is not None and problem.startswith("memo index"), (pos, bit, problem)
    assert flips > 0  # the flips do reach the memo
    assert memo_problem(data) is None
