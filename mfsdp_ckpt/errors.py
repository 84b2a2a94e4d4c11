"""One exception family for the checkpoint layer. Every message names the file, key or rank at
fault, on one line, so the CLI can print it as is."""

from __future__ import annotations

from typing import Sequence


class CheckpointError(Exception):
    """Base class: anything wrong with a checkpoint or with how it is used."""


class NotACheckpointError(CheckpointError):
    """The path does not exist or holds no checkpoint."""


class UncommittedCheckpointError(CheckpointError):
    """The directory has no committed manifest (a save that did not finish, or a foreign dir)."""


class CorruptCheckpointError(CheckpointError):
    """A data file is truncated, unreadable, or its bytes do not match their checksum."""


class UnsafeCheckpointError(CheckpointError):
    """The checkpoint's metadata would run code or load an object we do not admit."""


class StateMismatchError(CheckpointError):
    """Keys, shapes or parameter groups of the checkpoint do not match the model / optimizer."""


class CheckpointExistsError(CheckpointError):
    """The destination already holds a checkpoint and overwriting was not asked for."""


class ConversionError(CheckpointError):
    """A conversion to or from another format (the Hugging Face bridge) cannot be done as asked:
    an unknown architecture, a model config the mapping cannot express, a missing or unexpected
    tensor, a shape mismatch."""


class OutsideCheckpointError(UnsafeCheckpointError):
    """A checkpoint names a file outside its directory. ``reason`` is the short account."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = path, reason


class RunLockedError(CheckpointError):
    """Another process holds the run directory's lock."""


class WriteFailedError(CheckpointError):
    """The operating system refused a write (a full disk, a quota, a read-only file system)."""


class CatalogError(ValueError):
    """The plan, mesh and keys do not describe a checkpoint (a message naming what is wrong)."""


class ChunkFault(Exception):
    """What is wrong with one chunk (the caller adds the file and key)."""


class JobFailedElsewhere(CheckpointError):
    """Raised on the processes of a job that did not fail when another did (``rank``): that one
    raises its own error, and the job reports the failure once, in its words."""

    def __init__(self, message: str, rank: int) -> None:
        super().__init__(message)
        self.rank = rank


class JobLostError(CheckpointError):
    """A collective of the job failed: another process died (killed, out of memory) or the
    connection to it broke. Nothing was committed."""


def raise_key_problems(
    source: str, problems: Sequence[tuple[str, Sequence[str]]], error: type[CheckpointError] = CheckpointError
) -> None:
    """Raise one ``error`` naming every key of every non-empty problem (``label: k1, k2; …``), or
    nothing when all lists are empty: a mismatch is reported whole, on one line."""
    parts = [f"{label}: {', '.join(keys)}" for label, keys in problems if keys]
    if parts:
        raise error(f"{source}: " + "; ".join(parts))


def one_line(text: object, limit: int | None = None, *, first_line: bool = False, mark: str = "") -> str:
    """``str(text)`` (an exception, or a message) as one line of a refusal: every run of
    whitespace, line breaks included, made one space; with ``first_line``, only its first
    non-blank line (for messages whose later lines are a long account, as torch.load's are). Cut
    to ``limit`` characters, ``mark`` (``"..."``) after a cut: another library's message is quoted,
    not echoed whole. The one place this is done; each caller picks the length its message affords."""
    out = str(text)
    if first_line:
        out = (out.strip().splitlines() or [""])[0]
    out = " ".join(out.split())
    if limit is not None and len(out) > limit:
        out = out[:limit] + mark
    return out


def shown_list(items: Sequence[object], limit: int = 4) -> str:
    """``items`` joined for a one-line message, at most ``limit`` of them: ``a, b, c and 2 more``.
    A refusal that cuts a list says how much it left out, so the reader knows it is not whole."""
    names = [str(i) for i in items]
    if len(names) <= limit:
        return ", ".join(names)
    return f"{', '.join(names[:limit])} and {len(names) - limit} more"
