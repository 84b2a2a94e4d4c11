"""The names of a checkpoint's files and markers, and what a name may be: one place for every
layer (the storage below the format, the readers and writers above it).

A committed checkpoint directory holds DCP's ``.metadata`` and data files (``__<rank>_<n>.distcp``:
:func:`dcp_data_file`) and our manifest
``mfsdp.json`` (written last: its presence marks the commit). A run directory holds checkpoint
directories, ``latest`` (the newest committed one's name), a ``latest-checkpoint`` link for
people, the writer lock, and partial directories (``<name>.partial-<id>``) while saves run.
"""

from __future__ import annotations

import os
import re

__all__ = [
    "MANIFEST_NAME",
    "METADATA_NAME",
    "LATEST_NAME",
    "LATEST_LINK_NAME",
    "LOCK_NAME",
    "PARTIAL_MARK",
    "REPLACED_MARK",
    "MCORE_METADATA_NAME",
    "DATA_FILE_SUFFIX",
    "is_dcp_data_file",
    "dcp_data_file",
    "dcp_data_file_rank",
    "shown",
    "member_name_problem",
]

MANIFEST_NAME = "mfsdp.json"
METADATA_NAME = ".metadata"
LATEST_NAME = "latest"
LATEST_LINK_NAME = "latest-checkpoint"
LOCK_NAME = ".mfsdp.lock"
PARTIAL_MARK = ".partial-"
REPLACED_MARK = ".replaced-"
MCORE_METADATA_NAME = "metadata.json"  # what marks a Megatron-Core dist_checkpointing directory
DATA_FILE_SUFFIX = ".distcp"  # DCP's (torch.distributed.checkpoint.filesystem.DEFAULT_SUFFIX)
_DATA_FILE_AT_END = re.compile(r"__(\d+)_\d+" + re.escape(DATA_FILE_SUFFIX) + "$")


def dcp_data_file(rank: int, n: int = 0) -> str:
    """The name DCP gives the ``n``-th data file of writer ``rank``: ``__{rank}_{n}.distcp``
    (an offline tool writes as rank 0 and numbers its files; a save's ranks write one each)."""
    return f"__{rank}_{n}{DATA_FILE_SUFFIX}"


def is_dcp_data_file(name: str) -> bool:
    """Whether ``name`` is a data file name DCP gives, ``__<rank>_<n>.distcp``."""
    found = _DATA_FILE_AT_END.search(name)
    return found is not None and found.start() == 0


def dcp_data_file_rank(path: str) -> int | None:
    """The writer rank in the name that ``path`` ends with, ``__<rank>_<n>.distcp``; None for a
    name DCP does not give."""
    found = _DATA_FILE_AT_END.search(path)
    return int(found.group(1)) if found else None


def shown(value: object, limit: int = 80) -> str:
    """``value`` for a one-line message: a plain short string as is, anything else (control
    characters, other types, long strings) as a truncated ``repr``."""
    if isinstance(value, str) and value.isprintable() and len(value) <= limit:
        return value
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        text = f"<an integer of {value.bit_length()} bits>"  # repr of a huge int may itself fail
    elif isinstance(value, (str, bytes, int, float, bool, type(None))):
        text = repr(value if not isinstance(value, (str, bytes)) else value[: limit + 1])
    else:
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def member_name_problem(name: object) -> str | None:
    """Why ``name`` cannot name a file inside a checkpoint (None if it can): it must be a
    non-empty relative path without ``..`` components, NUL or control characters."""
    if not isinstance(name, str):
        return f"a file name must be a string, not {type(name).__name__}"
    if not name or not name.isprintable():
        return f"file name {shown(name)} is empty or holds control characters"
    if name.startswith(("/", "\\")) or os.path.isabs(name) or (len(name) > 1 and name[1] == ":"):
        return f"file name {shown(name)} is absolute"
    if ".." in name.replace("\\", "/").split("/"):
        return f"file name {shown(name)} leads out of the checkpoint directory"
    return None
