"""Checkpoints on object stores during training (``s3://`` through fsspec / s3fs).

What this module adds to :mod:`mfsdp_ckpt.storage.fs` for ``save`` / ``load`` on a URL:

* client settings: botocore's ``adaptive`` retry mode (backs off on throttling, ``503 SlowDown``,
  and on dropped connections) and a multipart part size of :data:`PART_BYTES`, merged under
  whatever the user configured the usual fsspec way (``FSSPEC_S3_*`` variables, fsspec config);
* whole-object uploads with a bounded retry and exponential backoff (:func:`upload`): a data file
  is spooled (in memory, or in a local temporary file past :data:`SPOOL_BYTES`) while DCP writes
  it, then uploaded in one PUT, or as a parallel multipart upload when larger than a part, so that
  a failed upload can be repeated whole. A final failure is one line naming the object;
* :class:`RemoteFileSystem`, DCP's file-system interface on such uploads;
* the start-up probe of a prefix (:func:`check_writable_prefix`) and the removal of what killed
  saves left behind (:func:`remove_uncommitted`).

There is no lock on an object store (no ``flock``, and conditional writes are not portable across
S3-compatible servers): one writer per prefix is the user's responsibility. Credentials come from
the usual environment (``AWS_*`` variables, profiles, instance roles) and are never logged: the
errors here name objects and the store's reason, never the client's configuration.
"""

from __future__ import annotations

import contextlib
import io
import os
import posixpath
import tempfile
import uuid
from typing import IO, Any, Iterator

from torch.distributed.checkpoint.filesystem import FileSystemBase

from mfsdp_ckpt.errors import CheckpointError
from mfsdp_ckpt.format.names import MANIFEST_NAME, METADATA_NAME, is_dcp_data_file
from mfsdp_ckpt.storage import fs
from mfsdp_ckpt.storage.remote import SPOOL_BYTES, filesystem, reason, retrying, upload

__all__ = ["RemoteFileSystem", "check_writable_prefix", "bucket_of", "remove_uncommitted", "is_checkpoint_file"]

_BUCKET_SCHEMES = ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss")  # stores whose first path part is a bucket


class _UploadStream:
    """A write-only stream that becomes the object ``url`` when closed (not when discarded):
    bytes are spooled in memory, then in a local temporary file past :data:`SPOOL_BYTES`. Not an
    ``io`` class on purpose: their finalizer calls ``close``, which would upload a half-written
    file that was dropped by an exception."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._buf: IO[bytes] = io.BytesIO()
        self._spilled: IO[bytes] | None = None
        self._done = False
        self.closed = False

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        n = self._buf.write(data)
        if self._spilled is None and self._buf.tell() > SPOOL_BYTES:
            spill = tempfile.NamedTemporaryFile(prefix="mfsdp-upload-")
            assert isinstance(self._buf, io.BytesIO)
            spill.write(self._buf.getbuffer())
            self._buf = self._spilled = spill
        return n

    def tell(self) -> int:
        return self._buf.tell()

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        return self._buf.seek(pos, whence)

    def flush(self) -> None:
        self._buf.flush()

    def close(self) -> None:
        """Upload (once), then release the spool; an upload that fails raises ``OSError``."""
        if self._done:
            return
        self._done = True
        try:
            if self._spilled is not None:
                self._spilled.flush()
                upload(self.url, self._spilled.name)
            else:
                assert isinstance(self._buf, io.BytesIO)
                upload(self.url, self._buf.getvalue())
        finally:
            self.discard()

    def discard(self) -> None:
        """Drop the spooled bytes without uploading."""
        self._done = True
        with contextlib.suppress(Exception):
            self._buf.close()
        self.closed = True


class RemoteFileSystem(FileSystemBase):
    """DCP's file-system interface on an fsspec URL: every file written becomes an object when its
    stream closes (:class:`_UploadStream`); a stream left by an exception uploads nothing."""

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        url = os.fspath(path)
        if "w" not in mode:
            with fs.open_file(url, "rb") as f:
                yield f
            return
        stream = _UploadStream(url)
        try:
            yield stream
        except BaseException:
            stream.discard()
            raise
        stream.close()

    def concat_path(self, path: str | os.PathLike, suffix: str) -> str:
        return posixpath.join(os.fspath(path), suffix)

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        src, dst = os.fspath(path), os.fspath(new_path)
        data = retrying(src, "read", lambda: fs.read_bytes(src))
        upload(dst, data)
        retrying(src, "delete", lambda: fs.remove_tree(src))

    def init_path(self, path: str | os.PathLike) -> str:
        return fs.normalize(path)

    def mkdir(self, path: str | os.PathLike) -> None:
        """Object stores have no directories."""

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return fs.is_url(checkpoint_id)

    def exists(self, path: str | os.PathLike) -> bool:
        return fs.exists(os.fspath(path))

    def rm_file(self, path: str | os.PathLike) -> None:
        fs.remove_tree(os.fspath(path))


def bucket_of(url: str) -> str | None:
    """``s3://bucket`` for a URL of a bucket store (None for other schemes)."""
    scheme, _, rest = url.partition("://")
    return f"{scheme}://{rest.split('/', 1)[0]}" if scheme in _BUCKET_SCHEMES else None


NO_CREDENTIALS = (
    "no S3 credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) in "
    "the environment, or FSSPEC_S3_ANON=true for a public bucket"
)


def missing_credentials(url: str) -> str | None:
    """Why requests to ``url`` cannot be signed, when that is so: an ``s3://`` URL, no anonymous
    access configured, and no credentials in botocore's chain (environment, profile files,
    instance role). None otherwise. Asked only once a request has failed or a bucket looks
    absent: s3fs reports a missing bucket and missing credentials alike."""
    if url.partition("://")[0] not in ("s3", "s3a"):
        return None
    import fsspec.config

    options = fsspec.config.conf.get("s3", {})
    if str(options.get("anon", "")).lower() in ("1", "true") or options.get("key") or options.get("profile"):
        return None
    try:
        import botocore.session

        found = botocore.session.Session().get_credentials()
    except Exception:  # noqa: BLE001 - a broken profile file: botocore's own error surfaces later
        return None
    return None if found is not None else NO_CREDENTIALS


def check_bucket(url: str) -> None:
    """Refuse, in one line, a URL whose bucket does not exist or cannot be reached (naming
    missing credentials when that is the reason)."""
    bucket = bucket_of(url)
    if bucket is None:
        return
    try:
        found = fs.exists(bucket)
    except Exception as e:  # noqa: BLE001 - unreachable endpoint, bad credentials
        reason = missing_credentials(url)
        raise CheckpointError(f"{url}: {reason or f'cannot reach {bucket} ({reason(e)})'}") from None
    if not found:
        reason = missing_credentials(url)
        if reason:
            raise CheckpointError(f"{url}: {reason}")
        raise CheckpointError(
            f"{url}: {bucket} does not exist or cannot be reached (create the bucket first; "
            "check the endpoint and credentials in the environment)"
        )


def check_writable_prefix(url: str) -> None:
    """Raise a one-line :class:`CheckpointError` unless objects can be written under ``url``: the
    bucket exists, and a probe object is written and deleted (no retries: a start-up check)."""
    url = fs.normalize(url)
    check_bucket(url)
    probe = fs.join(url, f".mfsdp-probe-{uuid.uuid4().hex}")
    try:
        store, path = filesystem(probe)
        store.pipe_file(path, b"probe")
        store.rm_file(path)
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"{url}: cannot write objects there ({reason(e)})") from None


def is_checkpoint_file(name: str) -> bool:
    """A file name a DCP save writes (``.metadata``, ``__<rank>_<n>.distcp``)."""
    return name in (METADATA_NAME, METADATA_NAME + ".tmp") or is_dcp_data_file(name)


def remove_uncommitted(parent: str, only: str | None = None) -> list[str]:
    """Remove the prefixes under ``parent`` (or just ``only``) that hold nothing but files a save
    writes and no ``mfsdp.json``: what a killed or failed save left behind. Anything else is left
    alone. Returns the prefixes removed."""
    removed = []
    names = [posixpath.basename(only)] if only is not None else (fs.listdir(parent) if fs.isdir(parent) else [])
    for name in names:
        d = fs.join(parent, name)
        if name.startswith(".") or not fs.isdir(d):
            continue
        files = fs.listdir(d)
        if MANIFEST_NAME in files or not files or not all(is_checkpoint_file(f) for f in files):
            continue
        retrying(d, "delete", lambda d=d: fs.remove_tree(d))
        removed.append(d)
    return removed
