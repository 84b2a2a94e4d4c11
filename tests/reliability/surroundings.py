"""A digest of everything around a run and its memory tier, so that a hostile case can show that
nothing outside them changed: every entry under a directory (links as their target text, never
followed; regular files by content; directories by their names), the run's and the tier's own
directories left out."""

from __future__ import annotations

import hashlib
import os
import stat

__all__ = ["digest"]


def digest(root: str | os.PathLike, skip: tuple[str | os.PathLike, ...] = ()) -> dict[str, str]:
    """``relative path -> what it is`` for every entry under ``root`` but those in or under
    ``skip``; compare two digests to show nothing changed."""
    root = os.fspath(root)
    skipped = {os.path.abspath(os.fspath(s)) for s in skip}
    out: dict[str, str] = {}
    for directory, dirs, files in os.walk(root, followlinks=False):
        dirs[:] = [d for d in dirs if os.path.abspath(os.path.join(directory, d)) not in skipped]
        for name in sorted(dirs + files):
            path = os.path.join(directory, name)
            if os.path.abspath(path) in skipped:
                continue
            st = os.lstat(path)
            rel = os.path.relpath(path, root)
            if stat.S_ISLNK(st.st_mode):
                out[rel] = "link -> " + os.readlink(path)
            elif stat.S_ISREG(st.st_mode):
                with open(path, "rb") as f:
                    out[rel] = f"file {st.st_size} " + hashlib.sha256(f.read()).hexdigest()
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = "directory"
            else:
                out[rel] = f"other {stat.S_IFMT(st.st_mode)}"
    return out
