"""The fleet gate's memory under stalled request bodies: how much it grows while many connections each send most of
a large body and then stop (the gate runs in this process, plain HTTP, a fake SuperLink behind it).

    python -m bench.gate_memory --stalled 512 --body-mb 60            # the gate as it is
    python -m bench.gate_memory --stalled 16 --body-mb 60 --module OLD.py  # another fleet_gate.py, e.g. an older one

Connections come from as many loopback addresses as ``--max-per-address`` needs (127.0.0.2, 127.0.0.3, ...).
Prints one JSON line: the connections, the body size, MiB sent, the gate's RSS before and its growth.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import socket
import threading
import time
from types import ModuleType

import httpx
import psutil

MIB = 1 << 20


def load_gate(path: str | None) -> ModuleType:
    if path is None:
        from deploy import fleet_gate

        return fleet_gate
    spec = importlib.util.spec_from_file_location("other_fleet_gate", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def measure(gate: ModuleType, stalled: int, body_mb: int) -> dict[str, float]:
    upstream = httpx.MockTransport(lambda request: httpx.Response(200))
    app = gate.gate_app("superlink:9093", None, transport=upstream, max_body=(body_mb + 1) * MIB)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = gate.gate_server(app, "127.0.0.1", port, None, max_connections=max(stalled + 8, 512))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not server.started:
        time.sleep(0.01)
    per_address = getattr(gate, "MAX_CONNECTIONS_PER_ADDRESS", stalled)
    process = psutil.Process()
    before = process.memory_info().rss
    held, sent, chunk = [], 0, b"x" * MIB
    head = f"POST /v1/fleet/push-object HTTP/1.1\r\nHost: gate\r\nContent-Length: {body_mb * MIB + 1}\r\n\r\n"
    for i in range(stalled):
        source = f"127.0.0.{2 + i // per_address}"
        client = socket.create_connection(("127.0.0.1", port), timeout=30, source_address=(source, 0))
        client.sendall(head.encode())
        with contextlib.suppress(OSError):  # refused part-way (503): the gate closed it
            for _ in range(body_mb):
                client.sendall(chunk)
                sent += MIB
        held.append(client)
    time.sleep(2.0)
    grown = (process.memory_info().rss - before) / MIB
    for client in held:
        client.close()
    server.should_exit = True
    return {"stalled": stalled, "body_mb": body_mb, "sent_mb": sent / MIB, "rss_before_mb": before / MIB,
            "grown_mb": round(grown, 1)}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stalled", type=int, default=512)
    parser.add_argument("--body-mb", type=int, default=60)
    parser.add_argument("--module", help="another fleet_gate.py to measure (default: deploy/fleet_gate.py)")
    args = parser.parse_args(argv)
    print(json.dumps(measure(load_gate(args.module), args.stalled, args.body_mb)))


if __name__ == "__main__":
    main()
