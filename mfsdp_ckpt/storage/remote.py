"""The fsspec client of every object-store access (``s3://`` through s3fs): its settings, and
whole-object operations retried with backoff.

* client settings: botocore's ``adaptive`` retry mode (backs off on throttling, ``503 SlowDown``,
  and on dropped connections) and a multipart part size of :data:`PART_BYTES`, merged under
  whatever the user configured the usual fsspec way (``FSSPEC_S3_*`` variables, fsspec config);
* :func:`retrying`: an action repeated with exponential backoff and jitter, a final failure one
  ``OSError`` naming the object; :func:`upload`, one object written whole that way.

Credentials come from the usual environment and are never logged: errors name objects and the
store's reason, never the client's configuration. :mod:`mfsdp_ckpt.storage.fs` is the interface the other
layers use; this module is what it runs on for URLs.
"""

from __future__ import annotations

import errno
import random
import time
from typing import Any, Callable

from mfsdp_ckpt.errors import one_line
from mfsdp_ckpt.format.names import shown

__all__ = [
    "PART_BYTES",
    "SPOOL_BYTES",
    "ATTEMPTS",
    "BACKOFF_S",
    "CLIENT_ATTEMPTS",
    "client_options",
    "filesystem",
    "retrying",
    "upload",
    "reason",
]

PART_BYTES = 64 * 2**20  # multipart part size (and s3fs's read block size)
SPOOL_BYTES = 256 * 2**20  # a data file larger than this is spooled to a local temporary file
ATTEMPTS = 4  # whole-object upload attempts (each request inside also has botocore's own retries)
BACKOFF_S = 0.5  # first wait between whole-object attempts; doubles each time, with jitter
CLIENT_ATTEMPTS = 10  # botocore's attempts per request (adaptive mode)


def client_options(protocol: str) -> dict[str, Any]:
    """Extra fsspec options for ``protocol``: for S3, adaptive retries and the part size, under
    the user's own settings (theirs win, key by key)."""
    if protocol not in ("s3", "s3a"):
        return {}
    import fsspec.config

    conf = fsspec.config.conf.get("s3", {}) or {}
    config_kwargs = dict(conf.get("config_kwargs") or {})
    config_kwargs.setdefault("retries", {"max_attempts": CLIENT_ATTEMPTS, "mode": "adaptive"})
    options: dict[str, Any] = {"config_kwargs": config_kwargs}
    if "default_block_size" not in conf:
        options["default_block_size"] = PART_BYTES
    return options


def reason(error: BaseException) -> str:
    """The store's reason for ``error``, one short line (no request details)."""
    text = one_line(error) or type(error).__name__
    return shown(text, 160)


def _permanent(error: BaseException) -> bool:
    """Errors that another attempt cannot fix: a missing bucket, access denied."""
    return isinstance(error, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError))


def retrying(url: str, what: str, action: Callable[[], Any], attempts: int | None = None) -> Any:
    """``action()``, repeated up to ``attempts`` (default :data:`ATTEMPTS`) times with exponential
    backoff and jitter when it fails; a final failure is an ``OSError`` naming ``url`` and the last
    reason."""
    attempts = attempts or ATTEMPTS
    last: BaseException | None = None
    for attempt in range(attempts):
        try:
            return action()
        except Exception as e:  # noqa: BLE001 - botocore, aiohttp and s3fs raise many kinds
            last = e
            if _permanent(e):
                break
            if attempt + 1 < attempts:
                time.sleep(BACKOFF_S * 2**attempt * (0.5 + random.random()))
    assert last is not None
    n = attempt + 1
    raise OSError(errno.EIO, f"{what} failed after {n} attempt{'s' if n > 1 else ''} ({reason(last)})", url) from None


def upload(url: str, data: bytes | str) -> None:
    """Store ``data`` (bytes, or the path of a local file) as the object ``url``: one PUT, or a
    parallel multipart upload of :data:`PART_BYTES` parts; retried whole (:func:`retrying`)."""

    def put() -> None:
        store, path = filesystem(url)
        if isinstance(data, str):
            store.put_file(data, path, chunksize=PART_BYTES)
        else:
            store.pipe_file(path, data, chunksize=PART_BYTES)

    retrying(url, "upload", put)


def filesystem(url: str) -> tuple[Any, str]:
    """The filesystem and its path for ``url``. fsspec shares one instance per configuration and
    caches listings in it; another process may have changed the store since (a checkpoint being
    committed or removed), so the listing cache is dropped before every use."""
    from fsspec.core import url_to_fs

    fs, path = url_to_fs(url, **client_options(url.partition("://")[0]))
    fs.invalidate_cache()
    return fs, path
