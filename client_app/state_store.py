"""A client's local state on the node's disk, so that a restarted SuperNode goes on with it.

Flower keeps ``context.state`` in the SuperNode's memory: a SuperNode that restarts has lost SimGrad's local
PQ-LoRA parts and signature EMA, the dual path's personal LoRA, MIRA's adapter, VEMoE's routers. After every
message the client writes the keys its adapter kind and strategy declare (``StrategySpec.state_keys``; never
SecAgg+'s keys, which hold this round's secrets) to ``<state-dir>/<run>/partition-<id>.pb`` (Flower's RecordDict
protobuf, written to a temporary file and renamed, so a kill leaves the old file or the new one). A message that
finds none of those keys in ``context.state`` (a fresh SuperNode) reads them back when the file belongs to the same
Flower run, or to an earlier one that this run resumes (``resume=true``; a fresh run starts fresh).

``<run>`` names the logical run: its ``run-dir`` and strategy, which a resumed run shares with the run it continues
(Flower's run id changes). Node-config ``state-dir`` sets the directory: default ``$TESSERA_CACHE/client-state``
on a SuperNode, and off in simulation (Ray keeps the state in memory; ``state-dir`` there turns it on).
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
from pathlib import Path

from flwr.app import ConfigRecord, Context, RecordDict
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto
from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict

from common.assets import cache_dir
from common.logs import get_logger
from common.node_config import node_settings

META = "tessera.state-meta"  # beside the state: the Flower run id it was written in
_WARNED: set[Path] = set()
log = get_logger("tessera.client")


def in_simulation() -> bool:
    ray = sys.modules.get("ray")  # Flower's simulation runs ClientApps in Ray actors
    return ray is not None and ray.is_initialized()


def state_root(context: Context) -> Path | None:
    """The node's state directory (node-config ``state-dir``, else the default on a SuperNode); None when
    persistence is off (simulation without ``state-dir``)."""
    configured = node_settings(context.node_config).state_dir
    if not configured:
        if in_simulation():
            return None
        configured = str(cache_dir() / "client-state")
    return Path(configured).expanduser()


def state_file(context: Context) -> Path | None:
    """Where this client's state lives on this node; None when persistence is off."""
    root = state_root(context)
    if root is None:
        return None
    run = f"{context.run_config.get('run-dir', '')}|{context.run_config.get('strategy', '')}"
    key = hashlib.sha256(run.encode()).hexdigest()[:16]
    return root / key / f"partition-{node_settings(context.node_config).partition_id}.pb"


def restore(context: Context, keys: tuple[str, ...], path: Path | None) -> str:
    """Put the saved ``keys`` back into a fresh ``context.state``; return a digest of what was read ("" if none)."""
    if path is None or not keys or any(k in context.state for k in keys) or not path.exists():
        return ""
    data = path.read_bytes()
    saved = recorddict_from_proto(ProtoRecordDict.FromString(data))
    meta = saved.config_records.get(META, ConfigRecord())
    same_run = meta.get("run-id") == str(context.run_id)
    if not same_run and not bool(context.run_config.get("resume", False)):
        return ""  # an earlier, finished run's: a fresh run starts fresh (and overwrites it)
    found = [key for key in keys if key in saved]
    for key in found:
        context.state[key] = saved[key]
    return hashlib.sha256(data).hexdigest()[:16] if found else ""


def save(context: Context, keys: tuple[str, ...], path: Path | None) -> str:
    """Write ``keys`` of ``context.state`` atomically; return the digest of what was written ("" if nothing). A
    directory that cannot be written costs the copy on disk, never the message: the state stays in memory, and the
    node says why once."""
    if path is None or not keys:
        return ""
    record = RecordDict({k: context.state[k] for k in keys if k in context.state})
    record[META] = ConfigRecord({"run-id": str(context.run_id)})  # a uint64: more than a ConfigRecord int holds
    data = recorddict_to_proto(record).SerializeToString()
    temporary = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=path.name, suffix=".tmp", delete=False) as handle:
            temporary = handle.name
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except OSError as err:
        if temporary is not None:
            Path(temporary).unlink(missing_ok=True)
        if path not in _WARNED:
            _WARNED.add(path)
            log.warning("client state not saved to %s (node-config state-dir): %s", path, err)
        return ""
    return hashlib.sha256(data).hexdigest()[:16]
