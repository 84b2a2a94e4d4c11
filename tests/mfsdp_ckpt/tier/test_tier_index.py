"""``tier.json``, the memory tier's one new record, is read bounded and checked field by field:
every malformed or hostile file is one ``CheckpointError`` line naming it, never a crash, a
hang or an unbounded read."""

from __future__ import annotations

import json
import os

import pytest

from mfsdp_ckpt.errors import CheckpointError
from mfsdp_ckpt.tier.layout import TIER_INDEX_NAME, TierFile, read_tier_index, tier_index

GOOD = tier_index(
    7,
    2,
    {
        "__0_0.distcp": TierFile(100, 1, 0),
        "__1_0.distcp": TierFile(0, 2, 1),
        ".metadata": TierFile(10, 3),
        "mfsdp.json": TierFile(20, 4),
    },
)


def _write(directory, content: bytes) -> str:
    with open(os.path.join(directory, TIER_INDEX_NAME), "wb") as f:
        f.write(content)
    return str(directory)


def test_a_written_index_reads_back(tmp_path):
    step, nodes, files = read_tier_index(_write(tmp_path, json.dumps(GOOD).encode()))
    assert (step, nodes) == (7, 2)
    assert files["__1_0.distcp"] == TierFile(0, 2, 1) and files["mfsdp.json"] == TierFile(20, 4, None)


def _with(key: str, value: object, section: str | None = None) -> bytes:
    """``GOOD`` with ``key`` (of ``section``, when given) set to ``value``."""
    doc = json.loads(json.dumps(GOOD))
    (doc if section is None else doc[section])[key] = value
    return json.dumps(doc).encode()


@pytest.mark.parametrize(
    ("content", "said"),
    [
        (b"", "not JSON"),
        (b'{"format": 1, "step": 7', "not JSON"),
        (b"\xff\xfe", "not JSON"),
        (b"[]", "not a memory-tier index of format 1"),
        (_with("format", 2), "not a memory-tier index of format 1"),
        (_with("step", -1), "'step', 'nodes' or 'files' missing or of the wrong type"),
        (_with("step", True), "'step', 'nodes' or 'files' missing or of the wrong type"),
        (_with("nodes", 0), "'step', 'nodes' or 'files' missing or of the wrong type"),
        (_with("files", {}), "'step', 'nodes' or 'files' missing or of the wrong type"),
        (_with("shared", {}), "'shared' does not list .metadata and mfsdp.json"),
        (_with("__0_0.distcp", [1, 2], "files"), "file entry '__0_0.distcp' is not [size, crc32c, node]"),
        (_with("__0_0.distcp", [1, 2, 2], "files"), "file entry '__0_0.distcp' is not [size, crc32c, node]"),
        (_with("__0_0.distcp", [1, 1 << 32, 0], "files"), "file entry '__0_0.distcp' is not [size, crc32c, node]"),
        (_with("__0_0.distcp", ["1", 2, 0], "files"), "file entry '__0_0.distcp' is not [size, crc32c, node]"),
        (_with("x", [1, 2, 0], "files"), "file entry 'x' is not [size, crc32c, node]"),
        (_with(".metadata", [1, -2], "shared"), "shared entry '.metadata' is not [size, crc32c]"),
    ],
)
def test_a_malformed_index_is_one_line_naming_the_file(tmp_path, content, said):
    directory = _write(tmp_path, content)
    with pytest.raises(CheckpointError) as e:
        read_tier_index(directory)
    message = str(e.value)
    assert "\n" not in message and message.startswith(os.path.join(directory, TIER_INDEX_NAME) + ": "), message
    assert said in message, message


def test_an_oversized_or_missing_or_linked_index_is_refused_without_reading_it_whole(tmp_path):
    big = tmp_path / "big"
    big.mkdir()
    with open(big / TIER_INDEX_NAME, "wb") as f:
        f.truncate(64 << 20)  # sparse: reading it whole would take 64 MiB
    with pytest.raises(CheckpointError, match=r"cannot read \(longer than 16777216 bytes\)"):
        read_tier_index(str(big))
    with pytest.raises(CheckpointError, match="cannot read"):
        read_tier_index(str(tmp_path / "missing"))
    linked = tmp_path / "linked"
    linked.mkdir()
    os.symlink(_write(tmp_path, json.dumps(GOOD).encode()) + "/" + TIER_INDEX_NAME, linked / TIER_INDEX_NAME)
    with pytest.raises(CheckpointError, match="a symlink leads outside the checkpoint directory"):
        read_tier_index(str(linked))
