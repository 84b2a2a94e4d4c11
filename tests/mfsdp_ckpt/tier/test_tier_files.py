"""Moving a memory tier's files between nodes (``move_files``): every rank's transfers at once,
in both directions, whole files renamed into place, and a file that leaves its sender damaged
(another crc32c, another size, missing) refused on arrival with a line naming it, while every
other transfer of the same call still completes."""

from __future__ import annotations

import os

import torch.distributed as dist

from mfsdp_ckpt.tier.files import Transfer, file_crc32c, move_files
from mfsdp_ckpt.tier.layout import TierFile
from tests.harness import run_ranks

#: per node (= rank here): file -> size; a large one (several MiB), an empty one, odd sizes
SIZES = {"big": (3 << 20) + 7, "empty": 0, "odd": 12345, "small": 1}


def _payload(rank: int, name: str) -> bytes:
    size = SIZES[name]
    seed = bytes([rank * 16 + len(name)]) * 251
    return (seed * (size // len(seed) + 1))[:size]


def _move(root: str, damage: str | None) -> tuple[str | None, list[str], dict[str, bytes]]:
    """Each of 2 ranks (one node each) writes its files, records their crc32c, then (``damage``)
    rank 1 spoils one of its own before sending; every file goes to the other node. Returns the
    error (or None), this node's listing, and the bytes of the files it received."""
    rank = dist.get_rank()
    mine = os.path.join(root, f"node{rank}")
    os.makedirs(mine, exist_ok=True)
    for name in SIZES:
        with open(os.path.join(mine, f"{rank}_{name}"), "wb") as f:
            f.write(_payload(rank, name))
    recorded = {f"{rank}_{name}": TierFile(*file_crc32c(os.path.join(mine, f"{rank}_{name}")), rank) for name in SIZES}
    gathered: list = [None, None]
    dist.all_gather_object(gathered, recorded)
    expected = {**gathered[0], **gathered[1]}
    if rank == 1 and damage == "flip":
        with open(os.path.join(mine, "1_odd"), "r+b") as f:
            f.seek(100)
            f.write(bytes([_payload(1, "odd")[100] ^ 0xFF]))
    elif rank == 1 and damage == "truncate":
        with open(os.path.join(mine, "1_big"), "r+b") as f:
            f.truncate(1000)
    elif rank == 1 and damage == "missing":
        os.remove(os.path.join(mine, "1_small"))
    transfers = [
        Transfer(name, f.node, 1 - f.node, os.path.join(root, f"node{f.node}"), os.path.join(root, f"node{1 - f.node}"))
        for name, f in sorted(expected.items())
    ]
    error = None
    try:
        move_files(transfers, expected, rank)
    except Exception as e:  # noqa: BLE001 - the message is the result
        error = f"{type(e).__name__}: {e}"
    received = {}
    for name in sorted(os.listdir(mine)):
        if not name.startswith(f"{rank}_"):
            with open(os.path.join(mine, name), "rb") as f:
                received[name] = f.read()
    return error, sorted(os.listdir(mine)), received


def test_every_file_crosses_both_ways_whole(tmp_path):
    out = run_ranks(_move, 2, str(tmp_path), None)
    for rank, (error, listing, received) in enumerate(out):
        other = 1 - rank
        assert error is None
        assert listing == sorted(f"{r}_{n}" for r in (0, 1) for n in SIZES)  # no .partial left
        assert received == {f"{other}_{n}": _payload(other, n) for n in SIZES}


def _assert_refused(out: list, name: str, why: str) -> None:
    error, listing, received = out[0]
    assert error is not None and error.startswith(f"CheckpointError: {name} from rank 1: arrived damaged ("), error
    assert why in error, error
    assert name not in listing and f"{name}.partial" not in listing, listing
    # every other file of the call arrived whole; the sender saw no error
    assert received == {f"1_{n}": _payload(1, n) for n in SIZES if f"1_{n}" != name}
    assert out[1][0] is None and out[1][2] == {f"0_{n}": _payload(0, n) for n in SIZES}


def test_a_byte_flipped_at_the_sender_is_refused_on_arrival(tmp_path):
    _assert_refused(run_ranks(_move, 2, str(tmp_path), "flip"), "1_odd", "crc32c")


def test_a_file_of_another_size_is_refused_without_its_bytes_travelling(tmp_path):
    _assert_refused(run_ranks(_move, 2, str(tmp_path), "truncate"), "1_big", "1000 bytes; recorded")


def test_a_file_missing_at_the_sender_is_named(tmp_path):
    _assert_refused(run_ranks(_move, 2, str(tmp_path), "missing"), "1_small", "missing at the sender")
