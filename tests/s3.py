"""A real S3-compatible server for tests: ``moto`` in server mode on 127.0.0.1, reached through
``s3fs`` exactly as a user's ``s3://`` URL would be (the endpoint comes from fsspec's environment
configuration, so subprocesses use it too)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from typing import Iterator

import pytest

S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """Start moto on 127.0.0.1 for the session; set the environment so that ``s3://`` URLs in
    this process and its children go there."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                raise RuntimeError("moto server did not start")
            time.sleep(0.2)
    import fsspec.config

    saved = {k: os.environ.get(k) for k in [*S3_ENV, "FSSPEC_S3_ENDPOINT_URL", "AWS_ENDPOINT_URL"]}
    # children read the endpoint from the environment (fsspec's FSSPEC_<PROTOCOL>_<KWARG>, and
    # botocore's AWS_ENDPOINT_URL as a second guard); this process's fsspec read its environment
    # at import, so it gets the same setting directly
    os.environ.update(S3_ENV, FSSPEC_S3_ENDPOINT_URL=endpoint, AWS_ENDPOINT_URL=endpoint)
    saved_conf = fsspec.config.conf.get("s3")
    fsspec.config.conf["s3"] = {**(saved_conf or {}), "endpoint_url": endpoint}
    try:
        yield endpoint
    finally:
        if saved_conf is None:
            fsspec.config.conf.pop("s3", None)
        else:
            fsspec.config.conf["s3"] = saved_conf
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture
def s3_bucket(s3_endpoint: str, request: pytest.FixtureRequest) -> str:
    """A fresh, empty bucket: ``s3://<name>``."""
    import fsspec

    name = "t-" + request.node.name.lower().replace("_", "-").replace("[", "-").replace("]", "")[:40] + f"-{time.time_ns() % 10**8}"
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    fs.mkdir(name)
    return f"s3://{name}"
