"""A real S3 endpoint on loopback for tests and benchmarks, and a proxy that misbehaves on purpose.

- :class:`MotoEndpoint`: moto's server mode (a real HTTP S3 API) on ``127.0.0.1`` and a free port.
- :class:`HttpProxy`: an HTTP/1.1-aware TCP proxy in front of it. It logs every request (method,
  path, status, body bytes), can add latency each way (``delay``; this kernel has no netem), and
  can inject faults into the next matching requests: ``"503"`` (SlowDown), ``"reset"`` (the
  connection dies before the request is forwarded), ``"reset_mid_body"`` (half a response, then
  a reset) and ``"stall"`` (no answer for ``stall_seconds``, then a reset).

Run as a script (``python tests/s3_support.py moto`` or ``... proxy --upstream PORT --delay
0.01``) it serves in its own process and prints its port, so a benchmark does not share the
interpreter lock with its servers.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import struct
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

REGION = "us-east-1"
# moto accepts any credentials; fixed fake ones keep botocore from looking for real ones.
ACCESS_KEY = "birdzarr-test-key"
SECRET_KEY = "birdzarr-test-secret-do-not-leak"


def s3_options(endpoint: str, **extra: Any) -> dict[str, Any]:
    """storage_options for s3fs talking to ``endpoint``."""
    return {
        "key": ACCESS_KEY,
        "secret": SECRET_KEY,
        "endpoint_url": endpoint,
        "client_kwargs": {"region_name": REGION},
        **extra,
    }


def s3_env(endpoint: str) -> dict[str, str]:
    """Environment for a subprocess (the CLI): the standard AWS variables, no storage_options."""
    env = dict(os.environ)
    env.update({
        "AWS_ACCESS_KEY_ID": ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        "AWS_DEFAULT_REGION": REGION,
        "AWS_ENDPOINT_URL": endpoint,
    })
    return env


class MotoEndpoint:
    """moto's S3 server in a thread of this process."""

    def __init__(self) -> None:
        import logging

        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.port = port
        self.url = f"http://{host}:{port}"

    def client(self) -> Any:
        import boto3

        return boto3.client(
            "s3", endpoint_url=self.url, region_name=REGION,
            aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
        )

    def create_bucket(self, name: str) -> str:
        self.client().create_bucket(Bucket=name)
        return name

    def stop(self) -> None:
        self._server.stop()


@pytest.fixture(scope="session")
def moto() -> Iterator[MotoEndpoint]:
    """One moto server for the whole test session (each test uses its own bucket or prefix)."""
    endpoint = MotoEndpoint()
    yield endpoint
    endpoint.stop()


@pytest.fixture
def proxy(moto: MotoEndpoint) -> Iterator[HttpProxy]:
    """A fresh fault-injecting proxy in front of the session's moto server."""
    server = HttpProxy(upstream_port=moto.port).start()
    yield server
    server.stop()


_buckets = iter(range(1_000_000))


def new_bucket(endpoint: MotoEndpoint) -> str:
    return endpoint.create_bucket(f"birdzarr-test-{next(_buckets)}")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Request:
    method: str
    path: str
    status: int
    body_bytes: int
    fault: str | None = None


@dataclass
class _Fault:
    kind: str
    remaining: int
    method: str | None
    path_contains: str


@dataclass
class HttpProxy:
    """HTTP/1.1 proxy on loopback in a thread with its own event loop (see module docstring)."""

    upstream_port: int
    delay: float = 0.0
    stall_seconds: float = 5.0
    port: int = 0
    log: list[Request] = field(default_factory=list)
    _faults: deque[_Fault] = field(default_factory=deque)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> HttpProxy:
        self.port = self.port or _free_port()
        self._loop = asyncio.new_event_loop()
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._handle, "127.0.0.1", self.port)
        )

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            self._loop.run_forever()
            self._loop.close()

        self._thread = threading.Thread(target=run, name="http-proxy", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        async def shutdown() -> None:
            self._server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=2)
            asyncio.get_running_loop().stop()

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop)
        self._thread.join(10)

    # -- control ---------------------------------------------------------------------------------
    def inject(
        self, kind: str, count: int = 1, *, method: str | None = "GET", path_contains: str = ""
    ) -> None:
        """Make the next ``count`` matching requests fail with ``kind``."""
        assert kind in ("503", "reset", "reset_mid_body", "stall"), kind
        with self._lock:
            self._faults.append(_Fault(kind, count, method, path_contains))

    def clear(self) -> None:
        with self._lock:
            self._faults.clear()
            self.log.clear()

    def requests(self, method: str | None = None) -> list[Request]:
        with self._lock:
            return [r for r in self.log if method is None or r.method == method]

    def _take_fault(self, method: str, path: str) -> str | None:
        with self._lock:
            for fault in self._faults:
                if (fault.method in (None, method)) and fault.path_contains in path:
                    fault.remaining -= 1
                    if fault.remaining <= 0:
                        self._faults.remove(fault)
                    return fault.kind
        return None

    def _record(self, request: Request) -> None:
        with self._lock:
            self.log.append(request)

    # -- the proxy -------------------------------------------------------------------------------
    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        try:
            if self.delay:
                await asyncio.sleep(2 * self.delay)  # the TCP handshake costs a round trip
            while True:
                try:
                    head = await client_r.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                method, path, headers = _parse_head(head)
                if headers.get("expect", "").lower() == "100-continue":
                    # Answer the interim response here so the body can be read before forwarding.
                    client_w.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                    head = _drop_header(head, b"expect")
                body = await _read_body(client_r, headers, is_request=True)
                fault = self._take_fault(method, path)
                if fault == "503":
                    self._record(Request(method, path, 503, 0, fault))
                    client_w.write(_SLOWDOWN)
                    await client_w.drain()
                    continue
                if fault == "reset":
                    self._record(Request(method, path, 0, 0, fault))
                    _abort(client_w)
                    return
                if fault == "stall":
                    self._record(Request(method, path, 0, 0, fault))
                    await asyncio.sleep(self.stall_seconds)
                    _abort(client_w)
                    return
                if self.delay:
                    await asyncio.sleep(self.delay)
                if upstream is None:
                    upstream = await asyncio.open_connection("127.0.0.1", self.upstream_port)
                up_r, up_w = upstream
                up_w.write(head + body)
                await up_w.drain()
                resp_head = await up_r.readuntil(b"\r\n\r\n")
                status, resp_headers = _parse_status(resp_head)
                # moto (werkzeug) closes every connection; S3 keeps them alive. Keep the client's
                # connection and reconnect upstream (on loopback, no delay) instead, so each
                # request does not pay a new TCP handshake that a real endpoint would not cost.
                upstream_closes = resp_headers.get("connection", "").lower() == "close" and (
                    "content-length" in resp_headers or "chunked" in resp_headers.get("transfer-encoding", "")
                )
                if upstream_closes:
                    resp_head = _drop_header(resp_head, b"connection")
                if self.delay:
                    await asyncio.sleep(self.delay)
                no_body = method == "HEAD" or status in (204, 304) or 100 <= status < 200

                def record(sent: int, method: str = method, path: str = path, status: int = status,
                           fault: str | None = fault) -> None:
                    self._record(Request(method, path, status, sent, fault))

                if no_body:
                    record(0)
                    client_w.write(resp_head)
                else:
                    await _pump_body(up_r, client_w, resp_head, resp_headers, fault, record)
                if fault == "reset_mid_body":
                    _abort(client_w)
                    return
                await client_w.drain()
                if upstream_closes:
                    upstream[1].close()
                    upstream = None
                    continue
                if resp_headers.get("connection", "").lower() == "close" or _until_close(resp_headers):
                    return
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            return
        except asyncio.CancelledError:
            return
        finally:
            if upstream is not None:
                upstream[1].close()
            if not client_w.is_closing():
                client_w.close()


_SLOWDOWN_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message><RequestId>proxy</RequestId></Error>"
)
_SLOWDOWN = (
    b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\n"
    + f"Content-Length: {len(_SLOWDOWN_BODY)}\r\n\r\n".encode()
    + _SLOWDOWN_BODY
)


def _parse_head(head: bytes) -> tuple[str, str, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    return method, path, _headers(lines[1:])


def _parse_status(head: bytes) -> tuple[int, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    return int(lines[0].split(" ", 2)[1]), _headers(lines[1:])


def _headers(lines: list[str]) -> dict[str, str]:
    out = {}
    for line in lines:
        if ":" in line:
            name, value = line.split(":", 1)
            out[name.strip().lower()] = value.strip()
    return out


def _drop_header(head: bytes, name: bytes) -> bytes:
    lines = head.split(b"\r\n")
    return b"\r\n".join(line for line in lines if not line.lower().startswith(name + b":"))


def _until_close(headers: dict[str, str]) -> bool:
    return "content-length" not in headers and "chunked" not in headers.get("transfer-encoding", "")


async def _read_body(reader: asyncio.StreamReader, headers: dict[str, str], *, is_request: bool) -> bytes:
    if "chunked" in headers.get("transfer-encoding", ""):
        parts = []
        while True:
            size_line = await reader.readuntil(b"\r\n")
            parts.append(size_line)
            size = int(size_line.split(b";")[0], 16)
            if size == 0:
                while True:  # trailers, then the empty line
                    line = await reader.readuntil(b"\r\n")
                    parts.append(line)
                    if line == b"\r\n":
                        return b"".join(parts)
            parts.append(await reader.readexactly(size + 2))
    length = int(headers.get("content-length", "0"))
    return await reader.readexactly(length) if length else b""


async def _pump_body(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes, headers: dict[str, str],
    fault: str | None, record: Callable[[int], None],
) -> None:
    """Forward a response (its head, then its body as it arrives: latency added per response,
    not per packet). ``record(body bytes)`` runs before the client can see the response end,
    so a test that reads the log after a request returns always finds that request in it."""
    if "chunked" in headers.get("transfer-encoding", ""):
        body = await _read_body(reader, headers, is_request=False)
        record(len(body))
        writer.write(head + (body[: len(body) // 2] if fault == "reset_mid_body" else body))
        return
    if "content-length" not in headers:  # the body ends when the connection closes, after this
        writer.write(head)
        total = 0
        while data := await reader.read(1 << 16):
            writer.write(data)
            total += len(data)
        record(total)
        return
    length = int(headers["content-length"])
    limit = length // 2 if fault == "reset_mid_body" else length
    pending, sent = head, 0
    if length == 0:
        record(0)
    while sent < length:  # large pieces: the proxy's CPU per GET shows up in benchmarks/s3.py
        data = await reader.readexactly(min(1 << 20, length - sent))
        piece = data[: max(0, limit - sent)]
        sent += len(data)
        if sent == length:
            record(length)
        writer.write(pending + piece)
        pending = b""
        await writer.drain()
    if pending:
        writer.write(pending)


def _abort(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP reset, as a failing load balancer would."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


def _serve_forever(kind: str, upstream: int, delay: float) -> None:
    """Script mode: serve in this process and print the port. Each line ``stats`` on stdin prints
    (and resets) a JSON summary of the proxy's requests; closing stdin stops the server."""
    import json

    proxy = None
    if kind == "moto":
        port = MotoEndpoint().port
    else:
        proxy = HttpProxy(upstream_port=upstream, delay=delay).start()
        port = proxy.port
    print(port, flush=True)
    for line in sys.stdin:
        if line.strip() == "stats" and proxy is not None:
            log = proxy.requests()
            proxy.clear()
            methods: dict[str, int] = {}
            for request in log:
                methods[request.method] = methods.get(request.method, 0) + 1
            body = sum(r.body_bytes for r in log if r.method == "GET")
            print(json.dumps({"requests": len(log), "methods": methods, "get_bytes": body}), flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=("moto", "proxy"))
    parser.add_argument("--upstream", type=int, default=0)
    parser.add_argument("--delay", type=float, default=0.0, help="seconds added each way")
    args = parser.parse_args()
    _serve_forever(args.kind, args.upstream, args.delay)
