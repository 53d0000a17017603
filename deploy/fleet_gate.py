"""The SuperLink's public face: a TLS proxy that passes the Fleet API and nothing else.

Flower 1.41-1.42's SuperLink serves the Fleet API (SuperNodes), the Control API (``flwr run``, ``flwr stop``, ...) and
the Runtime API (the ServerApp) on ONE HTTPS port, and open-source Flower has no user authentication on Control:
anyone who reaches that port and trusts its certificate can start a run, i.e. have every SuperNode install and
execute the app they send. SuperNode authentication does not help (it authenticates nodes on Fleet, not users on
Control), and ``flower-supernode --trusted-entities`` only accepts apps signed through Flower Hub, which an
offline federation cannot use.

So the SuperLink listens on 127.0.0.1 only (``deploy/superlink.sh``), where runs are submitted, and this gate
listens on the address the nodes reach. It terminates TLS with the SuperLink's certificate, forwards
``POST /v1/fleet/<method>`` (body and end-to-end headers, SuperNode-auth signatures included, unchanged) to the
SuperLink over TLS, and answers everything else with 403: Control and Runtime are never reachable from the network.
Proxy headers a client sends (``X-Forwarded-*``, ``Forwarded``, ``X-Real-IP``), hop-by-hop headers and those the
``Connection`` header names are dropped, and ``X-Forwarded-For`` is set to the client's real address (the
SuperLink's uvicorn trusts that header from 127.0.0.1, i.e. from the gate). The gate itself never reads proxy
headers.

Everything in front of authentication (which is the SuperLink's, per node) is bounded, so that strangers cannot
exhaust the host:

- ``--max-connections`` (512): open sockets, counted from the TCP accept (TLS handshakes included); a socket over it
  is closed at once, before any TLS state is allocated; ``--max-per-address`` (64) of them from one client address;
- ``--header-timeout`` (10 s): a connection must finish its TLS handshake and send complete request headers within
  this time of being accepted, or of its previous response (keep-alive); otherwise it is closed;
- request headers: at most 64 KiB (``MAX_HEADER_BYTES``): larger ones get 400 and the connection is closed;
- ``--max-body-mb`` (64 MiB; Flower sends arrays in 5 MB chunks): a larger ``Content-Length`` gets 413 before any
  of the body is read, and a chunked body is counted as it arrives and refused (413) as soon as it passes the cap;
- ``--max-bodies-mb`` (1024 MiB): the bodies being read at once, all connections together (each held as the chunks
  it came in, forwarded without a copy); a chunk that would pass it gets 503 and the node retries;
- ``--body-timeout`` (120 s): a body that sends no byte for this long gets 408, and so does one not complete within
  ``--body-deadline`` (300 s; a 4 MiB body takes 30-40 s on a 1 Mbit/s link with 5 % loss);
- a response draining to a slow client is given time while it makes progress (a 4 MiB response at 1 Mbit/s takes
  30 s); one that makes none for ``--header-timeout`` (a client that stopped reading) is cut;
- idle keep-alive connections are closed after 5 s (``KEEP_ALIVE_S``);
- a TLS connection reads into 32 KiB (``TLS_READ_BUFFER``), not asyncio's 256 KiB: with 2,000 silent sockets the
  gate holds 512 and its RSS grows by about 50 MB, and no further.
Each refusal (403, 408, 413, timed-out connection, bad headers, failed handshake) is logged at warning level with
the client's address (logger ``tessera.gate``); sockets refused at the cap, which cost a flood nothing, in a line a
second at most, with their count.

    python -m deploy.fleet_gate --listen 0.0.0.0:9092 --superlink 127.0.0.1:9093 --certs deploy/certs
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import re
import ssl
from asyncio import sslproto
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, ClassVar

import httpx
import uvicorn
from starlette.requests import ClientDisconnect, Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import request_response
from starlette.types import ASGIApp
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("tessera.gate")

FLEET_PATH = re.compile(r"^/v1/fleet/[a-z-]+$")  # every Fleet API method (flwr/supernode/fleet_http_client.py)
# hop-by-hop headers (RFC 9110 7.6.1, plus the legacy Proxy-Connection), those httpx sets from the forwarded request
# itself, and proxy headers a client could use to pose as someone else: never forwarded, in either direction
HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
}
DROPPED_HEADERS = HOP_BY_HOP | {"host", "content-length"}
PROXY_HEADERS = {"forwarded", "x-real-ip", "x-client-ip", "true-client-ip", "client-ip"}  # and every x-forwarded-*
REFUSED = (
    "tessera fleet gate: only the Fleet API (POST /v1/fleet/...) is served on this address; "
    "runs are submitted on the SuperLink's own host\n"
)

MIB = 1024 * 1024
MAX_BODY = 64 * MIB
# every body being read at once, together: 512 connections x 64 MiB would be 32 GiB (a review held 244 MiB with four
# stalled 60 MiB bodies); a chunk that would pass it gets 503 (the node retries, as it would a busy SuperLink)
MAX_BODIES_TOTAL = 1024 * MIB
BODY_TIMEOUT = 120.0  # the longest a body may stall (no byte)
BODY_DEADLINE = 300.0  # the longest a whole body may take: Flower's 5 MB chunks take 30-50 s at 1 Mbit/s, 5 % loss
MAX_CONNECTIONS = 512
MAX_CONNECTIONS_PER_ADDRESS = 64  # one host cannot hold every socket (the others' nodes locked out)
HEADER_TIMEOUT = 10.0
MAX_HEADER_BYTES = 64 * 1024
KEEP_ALIVE_S = 5
# asyncio gives every TLS connection a read buffer of SSLProtocol.max_size bytes, zero-filled (resident) when the
# socket is accepted: 256 KiB by default, i.e. 128 MiB for 512 silent sockets. Two TLS records fit in 32 KiB.
TLS_READ_BUFFER = 32 * 1024


def _named_by_connection(headers: list[tuple[bytes, bytes]]) -> set[str]:
    """The headers a ``Connection`` header declares hop-by-hop (``Connection: close, X-Secret``)."""
    named = set()
    for key, value in headers:
        if key.lower() == b"connection":
            named |= {token.strip().lower() for token in value.decode("latin-1").split(",") if token.strip()}
    return named


def _end_to_end(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """``headers`` without hop-by-hop, Connection-named and proxy headers (multiple values and order kept)."""
    dropped = DROPPED_HEADERS | PROXY_HEADERS | _named_by_connection(headers)
    kept = []
    for key, value in headers:
        name = key.decode("latin-1").lower()
        if name not in dropped and not name.startswith("x-forwarded-"):
            kept.append((key, value))
    return kept


class _BodyRefused(Exception):
    def __init__(self, response: Response) -> None:
        super().__init__(response.status_code)
        self.response = response


def _refuse(status: int, text: str, peer: str, why: str) -> _BodyRefused:
    log.warning("refused %s: %s", peer, why)
    # the rest of the body is never read: the connection cannot carry another request, so it is closed
    return _BodyRefused(PlainTextResponse(f"tessera fleet gate: {text}\n", status, headers={"Connection": "close"}))


class BodyBudget:
    """The bytes of request bodies the gate holds at once, across connections, and their cap."""

    def __init__(self, limit: int) -> None:
        self.limit, self.held = limit, 0

    def take(self, size: int) -> bool:
        """Hold ``size`` more bytes if that stays within the cap."""
        if self.held + size > self.limit:
            return False
        self.held += size
        return True

    def give(self, size: int) -> None:
        self.held -= size


async def _read_body(
    request: Request, peer: str, max_body: int, timeout: float, budget: BodyBudget, held: list[bytes], deadline: float
) -> None:
    """The request body into ``held`` (its chunks as they came: nothing is copied), read only up to ``max_body``
    bytes, with no silence of ``timeout`` seconds, within ``deadline`` seconds in all, and while every body held at
    once stays within ``budget`` (the caller gives the held bytes back)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.strip().isdigit() and int(declared) > max_body:
        raise _refuse(413, f"body over {max_body} bytes", peer, f"Content-Length {declared} > {max_body} (413)")

    # One wait per chunk, bounded by the silence limit and by what is left of the whole-body deadline. A deadline
    # wrapped around the loop instead (nested wait_for) can lose its cancel on Python 3.11 when a chunk lands as it
    # fires, and then the whole trickle is read.
    loop = asyncio.get_running_loop()
    ends = loop.time() + deadline
    size = 0
    chunks = request.stream().__aiter__()
    while True:
        left = ends - loop.time()
        wait = min(timeout, max(left, 0.0))
        try:  # a slow link is not a stalled one: the limit is on silence, the total is the deadline
            chunk = await asyncio.wait_for(chunks.__anext__(), wait)
        except StopAsyncIteration:
            return
        except asyncio.TimeoutError:
            if left <= timeout:
                raise _refuse(408, "body too slow", peer, f"body not complete within {deadline:g} s (408)") from None
            raise _refuse(408, "body stalled", peer, f"no body bytes for {timeout:g} s (408)") from None
        size += len(chunk)
        if size > max_body:
            raise _refuse(413, f"body over {max_body} bytes", peer, f"body over {max_body} bytes (413)")
        if not budget.take(len(chunk)):
            why = f"the bodies held at once would pass {budget.limit} bytes (--max-bodies-mb) (503)"
            raise _refuse(503, "busy, retry", peer, why)
        held.append(chunk)


async def _chunks(held: list[bytes]) -> AsyncIterator[bytes]:
    for chunk in held:
        yield chunk


def gate_app(
    superlink: str,
    ca_file: Path | None,
    timeout: float = 300.0,
    *,
    max_body: int = MAX_BODY,
    body_timeout: float = BODY_TIMEOUT,
    transport: httpx.AsyncBaseTransport | None = None,
    max_bodies: int = MAX_BODIES_TOTAL,
    body_deadline: float = BODY_DEADLINE,
) -> ASGIApp:
    """An ASGI app forwarding Fleet API calls to ``superlink`` (host:port, TLS verified with ``ca_file``).
    ``transport`` replaces httpx's network transport (tests: ``httpx.MockTransport``)."""
    budget = BodyBudget(max_bodies)
    verify: str | bool = str(ca_file) if ca_file is not None else True
    client = httpx.AsyncClient(  # trust_env=False: no HTTPS_PROXY or the like between the gate and its SuperLink
        base_url=f"https://{superlink}", verify=verify, timeout=timeout, transport=transport, trust_env=False
    )

    async def forward(request: Request) -> Response:
        host = request.client.host if request.client else "unknown"
        peer = f"{host}:{request.client.port}" if request.client else host
        if request.method != "POST" or not FLEET_PATH.match(request.url.path):
            log.warning("refused %s: %s %r (403)", peer, request.method[:20], request.url.path[:200])
            return PlainTextResponse(REFUSED, status_code=403, headers={"Connection": "close"})
        held: list[bytes] = []
        try:
            try:
                await _read_body(request, peer, max_body, body_timeout, budget, held, body_deadline)
            except _BodyRefused as refused:
                return refused.response
            except ClientDisconnect:
                return Response(status_code=400)  # nobody is left to read it
            size = sum(len(chunk) for chunk in held)
            headers = [
                *_end_to_end(request.headers.raw),
                (b"x-forwarded-for", host.encode("latin-1")),
                (b"content-length", str(size).encode()),  # the chunks go on as they came, never joined
            ]
            try:
                upstream = await client.post(request.url.path, content=_chunks(held), headers=headers)
            except httpx.HTTPError as err:  # the SuperLink is down or restarting: the node retries, as it would
                return PlainTextResponse(f"tessera fleet gate: SuperLink unreachable: {err}\n", status_code=503)
        finally:
            budget.give(sum(len(chunk) for chunk in held))
            held.clear()
        back = _end_to_end(upstream.headers.raw)
        kept = {k.decode("latin-1"): v.decode("latin-1") for k, v in back if k.lower() != b"content-encoding"}
        return Response(upstream.content, status_code=upstream.status_code, headers=kept)

    return request_response(forward)  # every method and path reaches forward (a Route would answer some 405)


class GateProtocol(H11Protocol):
    """uvicorn's h11 protocol, with the connection cap, the header deadline and TLS done here rather than by
    ``loop.create_server``: a socket over the cap is closed before any TLS state exists (asyncio allocates a 256 KiB
    buffer per TLS connection), and the deadline covers the handshake. Configure with ``gate_protocol``."""

    tls: ClassVar[ssl.SSLContext | None] = None
    max_connections: ClassVar[int] = MAX_CONNECTIONS
    max_per_address: ClassVar[int] = MAX_CONNECTIONS_PER_ADDRESS
    header_timeout: ClassVar[float] = HEADER_TIMEOUT
    live: ClassVar[set[GateProtocol]] = set()
    refused: ClassVar[int] = 0  # sockets refused at the cap since the last warning about it
    refused_logged_at: ClassVar[float] = float("-inf")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.peer = self.host = "unknown"
        self.raw: asyncio.Transport | None = None
        self.deadline: asyncio.TimerHandle | None = None
        self.handshake: asyncio.Task[None] | None = None
        self.timed_out = False
        self.early: list[bytes] = []  # TLS: bytes that came with the handshake's end, before start_tls returned
        self.unsent: int | None = None  # response bytes still buffered at the last deadline (progress check)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        peername = transport.get_extra_info("peername")
        self.peer = f"{peername[0]}:{peername[1]}" if isinstance(peername, tuple) else str(peername)
        self.host = str(peername[0]) if isinstance(peername, tuple) else self.peer
        if len(self.live) >= self.max_connections:
            transport.abort()
            self._log_refused_at_cap(f"{len(self.live)} connections open (--max-connections)")
            return
        if sum(1 for c in self.live if c.host == self.host) >= self.max_per_address:
            transport.abort()  # one host holding every socket would lock the other nodes out
            self._log_refused_at_cap(f"{self.max_per_address} connections open from {self.host} (--max-per-address)")
            return
        self.live.add(self)
        self.raw = transport
        self._arm_deadline()
        if self.tls is None:
            super().connection_made(transport)
            return
        transport.pause_reading()  # start_tls takes the socket over before a byte of the ClientHello is read
        self.handshake = self.loop.create_task(self._start_tls(transport, self.tls))

    def _log_refused_at_cap(self, why: str) -> None:
        cls = type(self)
        cls.refused += 1
        now = self.loop.time()
        if now - cls.refused_logged_at >= 1.0:  # a line a second at most: such refusals cost a flood nothing
            others = f" and {cls.refused - 1} other sockets since the last such line" if cls.refused > 1 else ""
            log.warning("refused %s%s: %s", self.peer, others, why)
            cls.refused, cls.refused_logged_at = 0, now

    async def _start_tls(self, raw: asyncio.Transport, context: ssl.SSLContext) -> None:
        try:
            tls = await self.loop.start_tls(
                raw, self, context, server_side=True, ssl_handshake_timeout=self.header_timeout
            )
        except Exception as err:  # ssl.SSLError, ConnectionError, TimeoutError: no connection may stay counted
            if not self.timed_out:
                log.warning("refused %s: TLS handshake failed: %r", self.peer, err)
            tls = None
        if tls is None or tls.is_closing():  # failed, or the client left during the handshake
            raw.abort()
            self._forget()
            return
        super().connection_made(tls)
        early, self.early = b"".join(self.early), []
        if early:
            super().data_received(early)

    def data_received(self, data: bytes) -> None:
        if self.transport is None:  # at most one read's worth: start_tls returns in the next loop iteration
            self.early.append(data)
            return
        super().data_received(data)

    def _arm_deadline(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
        self.deadline = self.loop.call_later(self.header_timeout, self._deadline_passed)

    def _unsent(self) -> int:
        """Response bytes written by the app but not yet taken by the network (TLS and TCP buffers)."""
        return sum(
            t.get_write_buffer_size() for t in {self.transport, self.raw} if t is not None and not t.is_closing()
        )

    def _deadline_passed(self) -> None:
        self.deadline = None
        if self.cycle is not None and not self.cycle.response_complete:
            return  # a request is being served (armed again when its response is complete)
        transport = self.transport or self.raw
        if transport is None:
            return
        # a response still draining to a slow client (4 MiB at 1 Mbit/s: 30 s) is not an idle connection: wait while
        # it makes progress; one that stalls for a whole timeout (a client that stopped reading) is cut below
        unsent = self._unsent()
        if unsent and (self.unsent is None or unsent < self.unsent):
            self.unsent = unsent
            self._arm_deadline()
            return
        self.unsent = None
        if not transport.is_closing():  # (a close already under way, e.g. a TLS close_notify unanswered, is cut)
            stage = "TLS handshake" if self.transport is None else "request headers"
            stage = "progress sending the response" if unsent else stage
            log.warning(
                "closed %s: no complete %s within %g s (--header-timeout)", self.peer, stage, self.header_timeout
            )
        self.timed_out = True
        transport.abort()

    def _forget(self) -> None:
        self.live.discard(self)
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self.unsent = None
        self._arm_deadline()  # for the next request's headers, or to bound a close (the peer may never answer it)

    def connection_lost(self, exc: Exception | None) -> None:
        self._forget()
        if self.transport is not None:  # not refused at the cap, TLS done
            super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        log.warning("refused %s: invalid or oversized request headers (400)", self.peer)
        super().send_400_response(msg)


def gate_protocol(
    tls: ssl.SSLContext | None,
    max_connections: int = MAX_CONNECTIONS,
    header_timeout: float = HEADER_TIMEOUT,
    max_per_address: int = MAX_CONNECTIONS_PER_ADDRESS,
) -> type[GateProtocol]:
    """A ``GateProtocol`` class with these limits and its own count of open connections."""

    class Configured(GateProtocol):
        pass

    Configured.tls, Configured.max_connections, Configured.header_timeout = tls, max_connections, header_timeout
    Configured.max_per_address = max_per_address
    Configured.live = set()
    return Configured


def tls_context(certfile: Path, keyfile: Path) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)  # TLS 1.2+, no client certificates asked
    context.load_cert_chain(str(certfile), str(keyfile))
    return context


def gate_server(
    app: ASGIApp,
    host: str,
    port: int,
    tls: ssl.SSLContext | None,
    max_connections: int = MAX_CONNECTIONS,
    header_timeout: float = HEADER_TIMEOUT,
    max_per_address: int = MAX_CONNECTIONS_PER_ADDRESS,
) -> uvicorn.Server:
    """The uvicorn server for ``app``: h11 with ``GateProtocol`` (uvicorn has no header deadline and its
    ``limit_concurrency`` only answers 503 to requests, never refusing a socket), plain asyncio loop, no proxy
    headers read (the client address is the socket's)."""
    if tls is not None and hasattr(sslproto.SSLProtocol, "max_size"):
        sslproto.SSLProtocol.max_size = TLS_READ_BUFFER  # process-wide: the gate's only asyncio TLS is its own
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        loop="asyncio",
        ws="none",  # a WebSocket upgrade would hand the socket to another protocol, out of the gate's count
        http=gate_protocol(tls, max_connections, header_timeout, max_per_address),
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
        timeout_keep_alive=KEEP_ALIVE_S,
        proxy_headers=False,
        server_header=False,
        lifespan="off",
        log_level="warning",
    )
    return uvicorn.Server(config)


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected host:port, got {text!r}")
    return host.strip("[]"), int(port)


def _positive(kind: type[int] | type[float]) -> Any:
    def parse(text: str) -> int | float:
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
        return value

    return parse


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen", type=_address, required=True, help="host:port the SuperNodes connect to")
    parser.add_argument("--superlink", required=True, help="the SuperLink's loopback host:port")
    parser.add_argument("--certs", type=Path, default=Path("deploy/certs"), help="from `python -m deploy.certs`")
    parser.add_argument(
        "--max-body-mb",
        type=_positive(int),
        default=MAX_BODY // MIB,
        help="request body cap, MiB (413); default %(default)s",
    )
    parser.add_argument(
        "--max-connections", type=_positive(int), default=MAX_CONNECTIONS, help="open sockets cap; default %(default)s"
    )
    parser.add_argument(
        "--max-per-address",
        type=_positive(int),
        default=MAX_CONNECTIONS_PER_ADDRESS,
        help="open sockets cap per client address; default %(default)s",
    )
    parser.add_argument(
        "--max-bodies-mb",
        type=_positive(int),
        default=MAX_BODIES_TOTAL // MIB,
        help="request bodies held at once, all connections together, MiB (503); default %(default)s",
    )
    parser.add_argument(
        "--body-deadline",
        type=_positive(float),
        default=BODY_DEADLINE,
        help="seconds a whole request body may take (408); default %(default)s",
    )
    parser.add_argument(
        "--header-timeout",
        type=_positive(float),
        default=HEADER_TIMEOUT,
        help="seconds for the TLS handshake and the request headers; default %(default)s",
    )
    parser.add_argument(
        "--body-timeout",
        type=_positive(float),
        default=BODY_TIMEOUT,
        help="seconds a request body may send nothing (408); default %(default)s",
    )
    args = parser.parse_args(argv)
    for name in ("ca.crt", "server.pem", "server.key"):
        if not (args.certs / name).is_file():
            parser.error(f"{args.certs / name} is missing: create it with `python -m deploy.certs`")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    host, port = args.listen
    app = gate_app(
        args.superlink,
        args.certs / "ca.crt",
        max_body=args.max_body_mb * MIB,
        body_timeout=args.body_timeout,
        max_bodies=args.max_bodies_mb * MIB,
        body_deadline=args.body_deadline,
    )
    tls = tls_context(args.certs / "server.pem", args.certs / "server.key")
    gate_server(app, host, port, tls, args.max_connections, args.header_timeout, args.max_per_address).run()


if __name__ == "__main__":
    main()
