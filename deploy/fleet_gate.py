"""The SuperLink's public face: a TLS proxy that passes the Fleet API and nothing else.

Flower 1.41's SuperLink serves the Fleet API (SuperNodes), the Control API (``flwr run``, ``flwr stop``, ...) and
the Runtime API (the ServerApp) on ONE HTTPS port, and open-source Flower has no user authentication on Control:
anyone who reaches that port and trusts its certificate can start a run, i.e. have every SuperNode install and
execute the app they send. SuperNode authentication does not help (it authenticates nodes on Fleet, not users on
Control), and ``flower-supernode --trusted-entities`` only accepts apps signed through Flower Hub, which an
offline federation cannot use.

So the SuperLink listens on 127.0.0.1 only (``deploy/superlink.sh``), where runs are submitted, and this gate
listens on the address the nodes reach. It terminates TLS with the SuperLink's certificate, forwards
``POST /v1/fleet/<method>`` (headers, SuperNode-auth signatures included, and body unchanged) to the SuperLink
over TLS, and answers everything else with 403: Control and Runtime are never reachable from the network.

    python -m deploy.fleet_gate --listen 0.0.0.0:9092 --superlink 127.0.0.1:9093 --certs deploy/certs
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

FLEET_PATH = re.compile(r"^/v1/fleet/[a-z-]+$")  # every Fleet API method (flwr/supernode/fleet_http_client.py)
# hop-by-hop headers and those httpx sets from the forwarded request itself
DROPPED_HEADERS = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "upgrade", "te"}
REFUSED = (
    "tessera fleet gate: only the Fleet API (POST /v1/fleet/...) is served on this address; "
    "runs are submitted on the SuperLink's own host\n"
)


def gate_app(superlink: str, ca_file: Path, timeout: float = 300.0) -> Starlette:
    """A Starlette app forwarding Fleet API calls to ``superlink`` (host:port, TLS verified with ``ca_file``)."""
    client = httpx.AsyncClient(base_url=f"https://{superlink}", verify=str(ca_file), timeout=timeout)

    async def forward(request: Request) -> Response:
        if request.method != "POST" or not FLEET_PATH.match(request.url.path):
            return PlainTextResponse(REFUSED, status_code=403)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in DROPPED_HEADERS}
        try:
            upstream = await client.post(request.url.path, content=await request.body(), headers=headers)
        except httpx.HTTPError as err:  # the SuperLink is down or restarting: the node retries, as it would
            return PlainTextResponse(f"tessera fleet gate: SuperLink unreachable: {err}\n", status_code=503)
        kept = {k: v for k, v in upstream.headers.items() if k.lower() not in DROPPED_HEADERS | {"content-encoding"}}
        return Response(upstream.content, status_code=upstream.status_code, headers=kept)

    return Starlette(routes=[Route("/{path:path}", forward, methods=["GET", "POST", "PUT", "DELETE", "PATCH"])])


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected host:port, got {text!r}")
    return host.strip("[]"), int(port)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen", type=_address, required=True, help="host:port the SuperNodes connect to")
    parser.add_argument("--superlink", required=True, help="the SuperLink's loopback host:port")
    parser.add_argument("--certs", type=Path, default=Path("deploy/certs"), help="from `python -m deploy.certs`")
    args = parser.parse_args(argv)
    for name in ("ca.crt", "server.pem", "server.key"):
        if not (args.certs / name).is_file():
            parser.error(f"{args.certs / name} is missing: create it with `python -m deploy.certs`")
    host, port = args.listen
    uvicorn.run(
        gate_app(args.superlink, args.certs / "ca.crt"),
        host=host,
        port=port,
        ssl_certfile=str(args.certs / "server.pem"),
        ssl_keyfile=str(args.certs / "server.key"),
        log_level="warning",
    )


if __name__ == "__main__":
    main()
