"""The fleet gate (deploy/fleet_gate.py) on its own: the Starlette app against a fake SuperLink (an httpx
MockTransport that records what reaches it), and the real uvicorn server on a loopback socket for what only a socket
shows (header deadline, header size, connection cap, TLS). Seconds, no network namespace (that is
tests/test_e2e_network.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import ssl
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from deploy import certs
from deploy.fleet_gate import gate_app, gate_server, tls_context

CLIENT = ("203.0.113.7", 40123)  # the address the app sees the request come from
AUTH = {  # what a SuperNode signs with (flwr/supernode/node_auth_http_interceptor.py)
    "flwr-public-key": "cHVibGlj",
    "flwr-signature": "c2lnbmVk",
    "flwr-timestamp": "2026-01-01T00:00:00Z",
    "content-type": "application/protobuf",
}


class Upstream:
    """A fake SuperLink: records every request that reaches it and answers 200 (or fails to connect)."""

    def __init__(self, down: bool = False) -> None:
        self.down = down
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if self.down:
            raise httpx.ConnectError("connection refused", request=request)
        self.requests.append(request)
        headers = {"content-type": "application/protobuf", "connection": "x-upstream-hop", "x-upstream-hop": "1"}
        return httpx.Response(200, content=b"reply:" + request.content[:16], headers=headers)


def app_and_upstream(**limits) -> tuple[object, Upstream]:
    upstream = Upstream()
    return gate_app("superlink:9093", None, transport=httpx.MockTransport(upstream), **limits), upstream


def call(app, method: str, path: str, **kwargs) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, client=CLIENT)
        async with httpx.AsyncClient(transport=transport, base_url="https://gate") as client:
            return await client.request(method, path, **kwargs)

    return asyncio.run(go())


class Body:
    """A streamed request body of ``chunks`` x ``size`` bytes that counts how many chunks the gate pulled."""

    def __init__(self, chunks: int, size: int = 1 << 20, delay: float = 0.0) -> None:
        self.chunks, self.size, self.delay, self.pulled = chunks, size, delay, 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for i in range(self.chunks):
            if self.delay:
                await asyncio.sleep(self.delay)
            self.pulled += 1
            yield bytes([i % 256]) * self.size


def test_only_fleet_posts_pass(caplog):
    app, upstream = app_and_upstream()
    caplog.set_level(logging.WARNING, logger="tessera.gate")
    for method, path in [
        ("POST", "/v1/control/start-run"),
        ("POST", "/v1/runtime/pull-messages"),
        ("POST", "/v1/fleet/%2e%2e/control/start-run"),
        ("POST", "/v1/fleet/pull-messages/extra"),
        ("POST", "/"),
        ("GET", "/v1/fleet/pull-messages"),
        ("PUT", "/v1/fleet/push-messages"),
        ("OPTIONS", "/v1/fleet/push-messages"),
        ("DELETE", "/v1/fleet/push-messages"),
    ]:
        response = call(app, method, path, content=b"x")
        assert response.status_code == 403, (method, path, response.status_code)
        assert "only the Fleet API" in response.text
    assert upstream.requests == []
    refusals = [r for r in caplog.records if r.name == "tessera.gate" and r.levelno == logging.WARNING]
    assert len(refusals) == 9 and all(CLIENT[0] in r.getMessage() for r in refusals), caplog.text


def test_a_fleet_post_reaches_the_superlink_unchanged():
    app, upstream = app_and_upstream()
    body = os.urandom(3 << 20)
    response = call(app, "POST", "/v1/fleet/push-object", content=body, headers=AUTH)
    assert response.status_code == 200 and response.content == b"reply:" + body[:16]
    assert response.headers["content-type"] == "application/protobuf"
    (forwarded,) = upstream.requests
    assert forwarded.method == "POST" and str(forwarded.url) == "https://superlink:9093/v1/fleet/push-object"
    assert forwarded.content == body
    assert {k: forwarded.headers[k] for k in AUTH} == AUTH
    assert forwarded.headers.get_list("x-forwarded-for") == [CLIENT[0]]


def test_proxy_and_hop_by_hop_headers_are_dropped_and_the_real_address_set():
    app, upstream = app_and_upstream()
    spoofed = [
        ("X-Forwarded-For", "127.0.0.1"),
        ("X-Forwarded-For", "10.0.0.1"),
        ("X-Forwarded-Proto", "http"),
        ("X-Forwarded-Host", "superlink"),
        ("Forwarded", "for=127.0.0.1;proto=https"),
        ("X-Real-IP", "127.0.0.1"),
        ("Proxy-Authorization", "Basic c2VjcmV0"),
        ("Proxy-Connection", "keep-alive"),
        ("Connection", "keep-alive, X-Hop-Secret"),
        ("Connection", "flwr-timestamp-shadow"),
        ("X-Hop-Secret", "1"),
        ("flwr-timestamp-shadow", "1"),
        ("Keep-Alive", "timeout=5"),
        ("TE", "trailers"),
        ("Trailer", "x-after"),
        ("Upgrade", "h2c"),
    ]
    headers = [*AUTH.items(), *spoofed, ("X-Kept", "yes")]
    response = call(app, "POST", "/v1/fleet/pull-messages", content=b"abc", headers=headers)
    assert response.status_code == 200
    (forwarded,) = upstream.requests
    for name, value in spoofed:  # (the gate's own httpx client says Connection: keep-alive to the SuperLink)
        assert value not in forwarded.headers.get_list(name), (name, forwarded.headers.get_list(name))
    assert {"forwarded", "x-real-ip", "proxy-authorization", "x-hop-secret", "te"}.isdisjoint(forwarded.headers)
    assert forwarded.headers.get_list("x-forwarded-for") == [CLIENT[0]]
    assert forwarded.headers["x-kept"] == "yes" and forwarded.content == b"abc"
    assert "x-upstream-hop" not in response.headers  # named by the SuperLink's Connection header


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
def test_a_body_over_the_cap_is_refused_without_reading_it(declared, caplog):
    app, upstream = app_and_upstream(max_body=4 << 20)
    caplog.set_level(logging.WARNING, logger="tessera.gate")
    body = Body(chunks=1000)  # 1000 MiB, if anybody read it all
    headers = {**AUTH, "content-length": str(1000 << 20)} if declared else AUTH
    response = call(app, "POST", "/v1/fleet/push-object", content=body, headers=headers)
    assert response.status_code == 413 and response.headers["connection"] == "close"
    assert upstream.requests == []
    assert body.pulled == (0 if declared else 5), body.pulled  # 5 MiB: the first chunk past the 4 MiB cap
    assert any("413" in r.getMessage() and CLIENT[0] in r.getMessage() for r in caplog.records), caplog.text


def test_a_chunked_body_under_the_cap_is_forwarded_whole():
    app, upstream = app_and_upstream(max_body=4 << 20)
    response = call(app, "POST", "/v1/fleet/push-object", content=Body(chunks=4), headers=AUTH)
    assert response.status_code == 200
    (forwarded,) = upstream.requests
    assert forwarded.content == b"".join(bytes([i]) * (1 << 20) for i in range(4))


def test_a_stalled_body_is_refused_a_slow_one_is_not():
    """A slow link (a chunk every 0.1 s, 1 s in all) is served; a body silent for the 1 s timeout, or one
    trickling past the 4 s whole-body deadline (--body-deadline), is refused with 408 and never forwarded. The
    margins are wide (a 0.1 s gap against a 1 s limit), so a loaded machine cannot make the slow link a stalled one."""
    app, upstream = app_and_upstream(body_timeout=1.0, body_deadline=4.0)
    slow = call(app, "POST", "/v1/fleet/push-object", content=Body(chunks=10, size=10, delay=0.1), headers=AUTH)
    assert slow.status_code == 200 and len(upstream.requests) == 1
    stalled = call(app, "POST", "/v1/fleet/push-object", content=Body(chunks=2, size=10, delay=2.0), headers=AUTH)
    endless = call(app, "POST", "/v1/fleet/push-object", content=Body(chunks=60, size=10, delay=0.1), headers=AUTH)
    assert stalled.status_code == endless.status_code == 408 and len(upstream.requests) == 1


def test_superlink_down_is_503():
    down = Upstream(down=True)
    app = gate_app("superlink:9093", None, transport=httpx.MockTransport(down))
    response = call(app, "POST", "/v1/fleet/pull-messages", content=b"x", headers=AUTH)
    assert response.status_code == 503 and "SuperLink unreachable" in response.text


# --- the real server on a loopback socket ----------------------------------------------------------------------


@contextlib.contextmanager
def running_gate(app, tls: ssl.SSLContext | None = None, **limits) -> Iterator[int]:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = gate_server(app, "127.0.0.1", port, tls, **limits)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the gate did not start"
        time.sleep(0.01)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5)


def read_until_closed(sock: socket.socket, seconds: float, trickle: bytes = b"") -> tuple[float, bytes]:
    """Seconds until the server closes ``sock`` (sending ``trickle`` every 0.2 s meanwhile), and what it sent."""
    start, received = time.monotonic(), b""
    sock.settimeout(0.2)
    while time.monotonic() - start < seconds:
        try:
            data = sock.recv(65536)
        except TimeoutError:
            try:
                sock.sendall(trickle)
            except OSError:
                break
            continue
        except OSError:  # reset
            break
        if not data:
            break
        received += data
    else:
        raise AssertionError(f"still open after {seconds} s")
    return time.monotonic() - start, received


def request(sock: socket.socket, path: str = "/") -> bytes:
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: gate\r\n\r\n".encode())
    sock.settimeout(5)
    return sock.recv(65536)


def request_with_handshake(port: int, context: ssl.SSLContext, path: str) -> bytes:
    """A TLS client that sends its request together with its last handshake flight (Finished), as a busy client does."""
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_hostname="127.0.0.1")
    with connect(port) as sock:
        while True:
            try:
                tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                sock.sendall(outgoing.read())
                incoming.write(sock.recv(65536))
        tls.write(f"GET {path} HTTP/1.1\r\nHost: gate\r\n\r\n".encode())
        sock.sendall(outgoing.read())  # Finished and the request: one segment
        while True:
            try:
                return tls.read(65536)
            except ssl.SSLWantReadError:
                data = sock.recv(65536)
                assert data, "closed without an answer"
                incoming.write(data)


def test_connections_without_complete_headers_are_closed_at_the_deadline(caplog):
    app, _ = app_and_upstream()
    caplog.set_level(logging.WARNING, logger="tessera.gate")
    with running_gate(app, header_timeout=1.0) as port:
        idle, partial, slow, served = connect(port), connect(port), connect(port), connect(port)
        partial.sendall(b"POST /v1/fleet/pull-messages HTTP/1.1\r\nHost: gate\r\n")
        assert request(served).startswith(b"HTTP/1.1 403")  # a complete request is answered at once
        start = time.monotonic()
        # a byte every 0.2 s does not keep a connection open (it would reset uvicorn's own keep-alive timer)
        for sock, trickle in [(idle, b""), (partial, b"X-Padding: 1\r\n"), (slow, b"G")]:
            read_until_closed(sock, 3.0, trickle)
            assert time.monotonic() - start < 2.5, "closed too late"
            sock.close()
        assert time.monotonic() - start > 0.7, "closed before the deadline"
        served.close()
    closed = [r.getMessage() for r in caplog.records if "--header-timeout" in r.getMessage()]
    assert len(closed) == 3 and all("127.0.0.1" in m for m in closed), caplog.text


def test_a_large_response_to_a_slow_reader_is_not_cut_at_the_header_deadline():
    """4 MiB answered to a client that reads 128 KiB every 0.1 s (3 s, three header timeouts): the connection is not
    idle while the response drains, so it completes (it was cut at the deadline: a SuperNode on a 1 Mbit/s link
    could not pull a 4 MiB message)."""
    payload = bytes(range(256)) * (4 * 4096)
    app = gate_app(
        "superlink:9093", None, transport=httpx.MockTransport(lambda request: httpx.Response(200, content=payload))
    )
    with running_gate(app, header_timeout=1.0) as port:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        sock.connect(("127.0.0.1", port))
        sock.sendall(b"POST /v1/fleet/pull-messages HTTP/1.1\r\nHost: gate\r\nContent-Length: 1\r\n\r\nx")
        sock.settimeout(5)
        received = b""
        while True:
            time.sleep(0.1)
            data = sock.recv(128 * 1024)
            if not data:
                break
            received += data
            if received.endswith(payload[-4096:]) and len(received) > len(payload):
                break
        sock.close()
    assert received.startswith(b"HTTP/1.1 200") and received.endswith(payload), len(received)


def test_oversized_headers_are_refused():
    app, upstream = app_and_upstream()
    with running_gate(app, header_timeout=5.0) as port, connect(port) as sock:
        big = b"POST /v1/fleet/pull-messages HTTP/1.1\r\nHost: gate\r\nX-Big: " + b"a" * (200 << 10) + b"\r\n\r\n"
        with contextlib.suppress(OSError):  # the gate may close before it has all of it
            sock.sendall(big)
        _, received = read_until_closed(sock, 3.0)
        assert received == b"" or received.split(b" ", 2)[1] in (b"400", b"431"), received[:100]
    assert upstream.requests == []


def test_sockets_over_the_cap_are_closed_at_once(caplog):
    app, _ = app_and_upstream()
    caplog.set_level(logging.WARNING, logger="tessera.gate")
    with running_gate(app, max_connections=2, header_timeout=5.0) as port:
        first, second = connect(port), connect(port)
        time.sleep(0.2)  # accepted
        with connect(port) as third:
            read_until_closed(third, 1.0)  # closed at once, not at the deadline
        assert request(first).startswith(b"HTTP/1.1 403") and request(second).startswith(b"HTTP/1.1 403")
        first.close()
        second.close()
        deadline = time.monotonic() + 3
        while True:  # the count goes down as sockets close: a new one is served again
            with connect(port) as sock:
                with contextlib.suppress(OSError):
                    if request(sock).startswith(b"HTTP/1.1 403"):
                        break
            assert time.monotonic() < deadline, "no connection accepted after the others closed"
            time.sleep(0.1)
    assert any("--max-connections" in r.getMessage() for r in caplog.records), caplog.text


def test_over_tls_a_fleet_post_passes_and_a_silent_handshake_is_cut(tmp_path: Path):
    certs.generate(tmp_path, ["127.0.0.1"], nodes=1)
    app, upstream = app_and_upstream()
    tls = tls_context(tmp_path / "server.pem", tmp_path / "server.key")
    with running_gate(app, tls, header_timeout=1.0) as port:
        silent, after_handshake = connect(port), connect(port)
        client_tls = ssl.create_default_context(cafile=str(tmp_path / "ca.crt"))
        wrapped = client_tls.wrap_socket(after_handshake, server_hostname="127.0.0.1")
        with httpx.Client(verify=client_tls, base_url=f"https://127.0.0.1:{port}") as client:
            response = client.post("/v1/fleet/pull-messages", content=b"hello", headers=AUTH)
            assert response.status_code == 200, response.text
            assert client.post("/v1/control/start-run", content=b"x").status_code == 403
        (forwarded,) = upstream.requests
        assert forwarded.content == b"hello" and forwarded.headers["x-forwarded-for"] == "127.0.0.1"
        # a request in the same segment as the handshake's last flight is served (it arrives before start_tls returns)
        assert request_with_handshake(port, client_tls, "/v1/control/start-run").startswith(b"HTTP/1.1 403")
        start = time.monotonic()
        read_until_closed(silent, 3.0)  # no ClientHello: closed at the deadline, before any TLS state
        read_until_closed(wrapped, 3.0)  # handshake done, no request
        assert time.monotonic() - start < 2.5
        silent.close()
        wrapped.close()


def test_the_bodies_held_at_once_are_capped_across_connections_and_given_back(caplog):
    """Stalled bodies held memory per connection only (512 x 64 MiB); now every body being read counts against one
    budget: a chunk that would pass it gets 503 and nothing of it is held, and a finished body gives its bytes back."""
    from deploy.fleet_gate import BodyBudget

    caplog.set_level(logging.WARNING, logger="tessera.gate")
    app, upstream = app_and_upstream(max_bodies=3 << 20)

    async def go() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app, client=CLIENT)
        async with httpx.AsyncClient(transport=transport, base_url="https://gate") as client:
            slow = [Body(chunks=2, delay=0.3) for _ in range(2)]  # 2 MiB each, the second MiB after 0.3 s
            return await asyncio.gather(*(client.post("/v1/fleet/push-object", content=b, headers=AUTH) for b in slow))

    first, second = asyncio.run(go())
    assert sorted([first.status_code, second.status_code]) == [200, 503]  # 4 MiB at once would pass the 3 MiB cap
    assert any("--max-bodies-mb" in r.getMessage() for r in caplog.records), caplog.text
    again = call(app, "POST", "/v1/fleet/push-object", content=Body(chunks=2), headers=AUTH)
    assert again.status_code == 200  # the bytes of both bodies were given back
    assert upstream.requests[-1].content == b"".join(bytes([i]) * (1 << 20) for i in range(2))
    budget = BodyBudget(10)
    assert budget.take(6) and not budget.take(5) and budget.held == 6


def test_one_address_cannot_hold_every_socket(caplog):
    """A host holding --max-per-address sockets gets no more, while another address still gets served (one host
    with 512 silent sockets locked every node out)."""
    app, _ = app_and_upstream()
    caplog.set_level(logging.WARNING, logger="tessera.gate")
    with running_gate(app, max_connections=10, max_per_address=2, header_timeout=5.0) as port:
        first, second = connect(port), connect(port)
        time.sleep(0.2)
        with connect(port) as third:
            read_until_closed(third, 1.0)  # 127.0.0.1 holds its 2: closed at once
        other_address = socket.create_connection(("127.0.0.1", port), timeout=5, source_address=("127.0.0.2", 0))
        with other_address as other:  # another client address (loopback has all of 127/8)
            assert request(other).startswith(b"HTTP/1.1 403")  # served (403: not a Fleet path)
        assert request(first).startswith(b"HTTP/1.1 403")
        first.close()
        second.close()
    assert any("--max-per-address" in r.getMessage() for r in caplog.records), caplog.text


def _gate_rss_growth(stalled: int, body_mb: int, **limits) -> float:
    """MiB the process grows by while ``stalled`` connections each send ``body_mb`` MiB of a body one byte longer,
    then stall (the gate runs in this process)."""
    import psutil

    app, _ = app_and_upstream(max_body=(body_mb + 1) << 20, **limits)
    process = psutil.Process()
    with running_gate(app, max_connections=2 * stalled, max_per_address=2 * stalled) as port:
        time.sleep(0.2)
        before = process.memory_info().rss
        sockets, chunk = [], b"x" * (1 << 20)
        for _ in range(stalled):
            sock = connect(port)
            head = f"POST /v1/fleet/push-object HTTP/1.1\r\nHost: gate\r\nContent-Length: {(body_mb << 20) + 1}\r\n\r\n"
            sock.sendall(head.encode())
            with contextlib.suppress(OSError):  # refused (503) part-way: the gate closed it
                for _ in range(body_mb):
                    sock.sendall(chunk)
            sockets.append(sock)
        time.sleep(1.0)  # every byte sent has been read
        grown = (process.memory_info().rss - before) / (1 << 20)
        for sock in sockets:
            sock.close()
    return grown


def _growth_in_a_fresh_process(**limits) -> float:
    import json
    import subprocess
    import sys

    tests = Path(__file__).resolve().parent
    code = f"import test_fleet_gate as t; print(t._gate_rss_growth(8, 8, **{limits!r}))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests), str(tests.parent)])}
    out = subprocess.run([sys.executable, "-c", code], cwd=tests, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_many_stalled_bodies_leave_the_gates_memory_within_its_body_budget():
    """Eight connections stall one byte short of an 8 MiB body (a gate in a fresh process each time, so that no
    earlier test's freed memory hides the growth): with a 16 MiB budget for all bodies at once the gate grows by
    less than half of what the same bodies cost it with the default 1 GiB budget (64 MiB of bodies held)."""
    unbounded = _growth_in_a_fresh_process()
    bounded = _growth_in_a_fresh_process(max_bodies=16 << 20)
    assert unbounded > 48, f"the bodies should have cost the unbounded gate about 64 MiB, it grew {unbounded:.0f}"
    assert bounded < unbounded / 2, f"with the budget the gate grew by {bounded:.0f} MiB, without {unbounded:.0f}"
