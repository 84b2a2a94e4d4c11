"""A real S3-compatible server for tests: ``moto`` in server mode on 127.0.0.1, reached through
``s3fs`` exactly as a user's ``s3://`` URL would be (the endpoint comes from fsspec's environment
configuration, so subprocesses use it too)."""

from __future__ import annotations

import contextlib
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
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                raise RuntimeError("moto server did not start") from None
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

    name = (
        "t-"
        + request.node.name.lower().replace("_", "-").replace("[", "-").replace("]", "")[:40]
        + f"-{time.time_ns() % 10**8}"
    )
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    fs.mkdir(name)
    return f"s3://{name}"


def use_endpoint(endpoint: str) -> None:
    """Point this process's ``s3://`` URLs (fsspec's config and the environment its children
    read) at ``endpoint``: for rank processes, which may have been forked before the fixture set
    the environment."""
    import fsspec.config

    os.environ.update(S3_ENV, FSSPEC_S3_ENDPOINT_URL=endpoint, AWS_ENDPOINT_URL=endpoint)
    fsspec.config.conf["s3"] = {**(fsspec.config.conf.get("s3") or {}), "endpoint_url": endpoint}


# ---- a fault-injecting reverse proxy -------------------------------------------------------------

_HOP = {
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
    "content-length",
}
SLOWDOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message><RequestId>proxy</RequestId></Error>"
)


class Faults:
    """What :class:`FaultProxy` does to each request, drawn from a seeded generator: ``drop``
    (close the connection before forwarding), ``lost`` (forward, then close without answering: the
    request took effect, the client does not know), ``slowdown`` (answer 503 SlowDown), ``cut``
    (forward, answer the headers and half the body, close), ``delay`` (sleep up to
    ``max_delay_s``, then forward). Shares are per request (of ``methods`` only, when given); the
    rest pass untouched."""

    KINDS = ("drop", "lost", "slowdown", "cut", "delay")

    def __init__(
        self, seed: int = 0, max_delay_s: float = 0.2, methods: tuple[str, ...] | None = None, **shares: float
    ) -> None:
        import random
        import threading

        unknown = set(shares) - set(self.KINDS)
        if unknown:
            raise ValueError(f"unknown faults {sorted(unknown)}")
        self.rng = random.Random(seed)
        self.shares = shares
        self.max_delay_s = max_delay_s
        self.methods = methods  # None: every method
        self.lock = threading.Lock()
        self.counts: dict[str, int] = {k: 0 for k in ("requests", *self.KINDS)}

    def draw(self, method: str = "GET") -> tuple[str | None, float]:
        if self.methods is not None and method not in self.methods:
            return None, 0.0
        with self.lock:
            self.counts["requests"] += 1
            x, acc = self.rng.random(), 0.0
            delay = self.rng.random() * self.max_delay_s
            for kind in self.KINDS:
                acc += self.shares.get(kind, 0.0)
                if x < acc:
                    self.counts[kind] += 1
                    return kind, delay
            return None, 0.0


class FaultProxy:
    """A threaded HTTP reverse proxy on 127.0.0.1 in front of ``upstream`` (the moto server),
    injecting :class:`Faults`. ``url`` is its endpoint; :attr:`faults` can be replaced while it
    runs (``FaultProxy.faults = Faults(...)``; ``Faults()`` passes everything)."""

    def __init__(self, upstream: str, faults: Faults | None = None) -> None:
        import http.client
        import http.server
        import threading
        from urllib.parse import urlsplit

        up = urlsplit(upstream)
        proxy = self
        self.faults = faults or Faults()
        self.log: list[tuple[str, str, int]] = []  # (method, path, status) of every forwarded request

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    out = bytearray()
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass
                            return bytes(out)
                        out += self.rfile.read(size)
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _abort(self) -> None:
                import socket as _socket

                self.close_connection = True
                with contextlib.suppress(OSError):
                    self.connection.shutdown(_socket.SHUT_RDWR)

            def _handle(self) -> None:
                body = self._body()
                kind, delay = proxy.faults.draw(self.command)
                if kind == "drop":
                    return self._abort()
                if kind == "slowdown":
                    self.send_response(503, "Slow Down")
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(SLOWDOWN)))
                    self.end_headers()
                    self.wfile.write(SLOWDOWN)
                    return
                if kind == "delay":
                    time.sleep(delay)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
                conn = http.client.HTTPConnection(up.hostname, up.port, timeout=120)
                try:
                    conn.request(
                        self.command,
                        self.path,
                        body=body if body or self.command in ("PUT", "POST") else None,
                        headers=headers,
                    )
                    resp = conn.getresponse()
                    data = resp.read()
                    out_headers = [(k, v) for k, v in resp.getheaders() if k.lower() not in _HOP]
                    length = resp.getheader("Content-Length") if self.command == "HEAD" else str(len(data))
                finally:
                    conn.close()
                proxy.log.append((self.command, self.path.split("?")[0], resp.status))
                if kind == "lost":
                    return self._abort()
                self.send_response(resp.status, resp.reason)
                for k, v in out_headers:
                    self.send_header(k, v)
                if length is not None:
                    self.send_header("Content-Length", length)
                self.end_headers()
                if self.command == "HEAD":
                    return
                if kind == "cut" and len(data) > 32:
                    self.wfile.write(data[: len(data) // 2])
                    self.wfile.flush()
                    return self._abort()
                self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        class Server(http.server.ThreadingHTTPServer):
            daemon_threads = True

        self.server = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def s3_proxy(s3_endpoint: str) -> Iterator[FaultProxy]:
    """A :class:`FaultProxy` in front of the session's moto server (passing everything until its
    ``faults`` are set). Point URLs at it with :func:`use_endpoint` (``proxy.url``); the fixture
    points them back at moto afterwards."""
    proxy = FaultProxy(s3_endpoint)
    try:
        yield proxy
    finally:
        use_endpoint(s3_endpoint)
        proxy.close()
