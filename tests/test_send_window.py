"""Sending to many simulated clients keeps a bounded window of messages in flight (``server_app/transport.py``):
Flower's in-memory simulation state scans every stored message for every node, so 1,000 messages at once cost
minutes. A small push/pull grid stands in for Flower's here (the real one runs in the sampling e2e tests)."""

from __future__ import annotations

import pytest
from flwr.app import Message, MessageType, RecordDict

from server_app import transport

pytestmark = pytest.mark.usefixtures("task_identity")  # Messages built outside an app (conftest)


class PushPullGrid:
    """Answers a pushed message on the second pull after it (nodes in ``silent`` never answer); records how many
    messages were waiting for a reply at the most."""

    def __init__(self, silent: frozenset[int] = frozenset()):
        self.silent = silent
        self.waiting: dict[str, tuple[Message, int]] = {}  # id -> (message, pulls seen)
        self.most_waiting = 0
        self.pushed: list[int] = []

    def push_messages(self, messages):
        ids = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = msg.object_id
            self.waiting[msg.metadata.message_id] = (msg, 0)
            self.pushed.append(msg.metadata.dst_node_id)
            ids.append(msg.metadata.message_id)
        self.most_waiting = max(self.most_waiting, len(self.waiting))
        return ids

    def pull_messages(self, message_ids):
        out = []
        for mid in list(message_ids):
            msg, pulls = self.waiting[mid]
            if pulls >= 1 and msg.metadata.dst_node_id not in self.silent:
                del self.waiting[mid]
                reply = Message(RecordDict(), reply_to=msg)
                out.append(reply)
            else:
                self.waiting[mid] = (msg, pulls + 1)
        return out


def messages(n: int) -> list[Message]:
    return [Message(RecordDict(), dst_node_id=nid, message_type=MessageType.QUERY) for nid in range(1, n + 1)]


def test_at_most_a_window_waits_and_every_node_gets_its_reply(monkeypatch):
    monkeypatch.setattr(transport, "PULL_INTERVAL", 0.0)
    grid = PushPullGrid()
    replies = transport._send_windowed(grid, messages(300), timeout=60, window=16)
    assert grid.most_waiting == 16
    assert sorted(grid.pushed) == list(range(1, 301))  # each sent once
    assert sorted(r.metadata.src_node_id for r in replies) == list(range(1, 301))


def test_a_silent_node_costs_its_slot_until_the_deadline_not_the_others(monkeypatch):
    monkeypatch.setattr(transport, "PULL_INTERVAL", 0.0)
    monkeypatch.setattr(transport, "SIMULATION_WINDOW", 8)
    monkeypatch.setattr(transport, "_in_simulation", lambda grid: True)
    grid = PushPullGrid(silent=frozenset({3, 40}))
    out = transport._send(grid, messages(50), timeout=2)
    assert {nid for nid, reply in out.items() if isinstance(reply, str)} == {3, 40}
    assert out[3] == "no reply within 2s"
    assert all(isinstance(out[nid], Message) for nid in set(range(1, 51)) - {3, 40})


def test_a_few_messages_go_through_the_grids_own_send_and_receive(monkeypatch):
    monkeypatch.setattr(transport, "_in_simulation", lambda grid: True)

    class Grid:
        def send_and_receive(self, msgs, *, timeout=None):
            self.got = list(msgs)
            return []

    grid = Grid()
    transport._send(grid, messages(transport.SIMULATION_WINDOW), timeout=1)
    assert len(grid.got) == transport.SIMULATION_WINDOW
