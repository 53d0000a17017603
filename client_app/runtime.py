"""What a client process keeps between messages: the base model (loaded once), the adapter, the data.

In simulation, Ray actors are long-lived, so one process serves many rounds and many virtual clients: the model
is cached per (model, quantisation, adapter settings) and the data per partition; per-client adapter state lives in
the client's ``context.state`` (``adapters.py``). ``model_loads`` counts how often
this process really loaded a base model; clients report it so tests (and users) can see that it stays at 1.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

from flwr.app import Context

from common.config import RunConfig
from common.data import Example, client_data
from common.logs import get_logger
from common.model import load_base_model, load_tokenizer

from .adapters import LoraAdapter, PQLoraAdapter, build_adapter

log = get_logger("tessera.client")

_MODELS: dict[tuple, tuple[Any, Any]] = {}  # (adapter holding the model, tokenizer)
_PROBES: dict[tuple, tuple[Any, Any]] = {}  # frozen probe models for signatures (when not the client's own)
_DATA: dict[tuple, tuple[list[Example], list[Example]]] = {}
model_loads = 0
model_load_seconds = 0.0
# How many base models this process keeps: unbounded in simulation (one Ray actor serves virtual clients of several
# models); the deployment model worker sets 1, so a long-lived node that sees a new model or adapter config frees
# the old one first.
max_models = 0
# This message's start-up: seconds before the handler ran (a fresh ClientApp process) + until its model was ready.
_startup = {"spawn": 0.0, "began": 0.0, "ready": 0.0}


def begin_message(spawn_seconds: float) -> None:
    _startup.update(spawn=spawn_seconds, began=time.perf_counter(), ready=0.0)


@dataclass
class ClientRuntime:
    """Everything one virtual client needs for a message: its config, the shared model, its data split."""

    cfg: RunConfig
    adapter: LoraAdapter | PQLoraAdapter  # holds the model: the frozen (4-bit) base with the adapter attached
    tokenizer: Any
    partition_id: int
    model_name: str
    train: list[Example]
    test: list[Example]
    names: list[str] = field(init=False)

    def __post_init__(self) -> None:
        self.names = self.adapter.names

    @property
    def model(self):
        return self.adapter.model

    def probe(self) -> tuple[Any, Any, bool]:
        """The frozen probe model for signatures, its tokenizer, and whether it is this client's own base model
        (then the caller must disable the adapter around it)."""
        name = self.cfg.simgrad.probe_model
        if name == self.model_name:
            return self.model, self.tokenizer, True
        key = (name, self.cfg.model.quantization, self.cfg.model.device, self.cfg.model.cpu_packed_inference)
        if key not in _PROBES:
            _PROBES[key] = (_load_base(name, self.cfg), load_tokenizer(name))
        return (*_PROBES[key], False)

    def identity(self) -> dict[str, Any]:
        """Who answered: reported beside every metric."""
        import resource

        tasks = ",".join(sorted({e.task for e in self.train}))
        return {
            "partition-id": self.partition_id,
            "tasks": tasks,
            "model": self.model_name,
            "pid": os.getpid(),
            "model-loads": model_loads,
            "model-load-seconds": model_load_seconds,
            "peak-rss-mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "startup-seconds": _startup["spawn"] + _startup["ready"],
        }


def get_runtime(context: Context) -> ClientRuntime:
    cfg = RunConfig.from_flat(dict(context.run_config))
    partition_id = int(context.node_config.get("partition-id", 0))
    num_partitions = int(context.node_config.get("num-partitions", 1))
    # A node's own setting wins; else the run's per-partition list; else the run's model.
    model_name = str(context.node_config.get("model", cfg.model_for_partition(partition_id)))
    adapter_settings = cfg.lora.model_dump_json() if cfg.adapter == "lora" else cfg.pqlora.model_dump_json() + cfg.simgrad.model_dump_json()
    key = (model_name, cfg.model.quantization, cfg.model.device, cfg.adapter, adapter_settings, cfg.seed,
           cfg.model.cpu_packed_inference)
    if key not in _MODELS:
        if max_models and len(_MODELS) >= max_models:
            _evict_oldest_model()
        _MODELS[key] = (build_adapter(_load_base(model_name, cfg), cfg), load_tokenizer(model_name))
    adapter, tokenizer = _MODELS[key]
    data_key = (cfg.data.model_dump_json(), partition_id, num_partitions, cfg.seed)
    if data_key not in _DATA:
        _DATA[data_key] = client_data(cfg.data, partition_id, num_partitions, cfg.seed)
    train, test = _DATA[data_key]
    if _startup["began"]:
        _startup["ready"] = time.perf_counter() - _startup["began"]
    return ClientRuntime(cfg, adapter, tokenizer, partition_id, model_name, train, test)


def _evict_oldest_model() -> None:
    import gc

    import torch

    key = next(iter(_MODELS))
    log.info("process %d: freeing base model %s (a node keeps %d)", os.getpid(), key[0], max_models)
    del _MODELS[key]
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _load_base(model_name: str, cfg: RunConfig):
    global model_loads, model_load_seconds
    _configure_process()
    log.info("process %d: loading base model %s (%s)", os.getpid(), model_name, cfg.model.quantization)
    started = time.perf_counter()
    base = load_base_model(model_name, cfg.model.quantization, cfg.model.device, cfg.model.cpu_packed_inference)
    model_loads += 1
    model_load_seconds += time.perf_counter() - started
    return base


def _configure_process() -> None:
    """Use the CPUs Flower/Ray gave this process (Ray sets OMP_NUM_THREADS), and keep the log readable."""
    import torch

    wanted = int(os.environ.get("OMP_NUM_THREADS", "0") or 0) or (os.cpu_count() or 1)
    torch.set_num_threads(max(1, wanted))
    # Progress bars from many actors interleave into noise in Flower's log; our own log lines say where we are.
    import warnings

    import datasets
    import transformers

    warnings.filterwarnings("ignore", message=".*base_model_name_or_path.*")  # peft: we set it when saving
    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")

    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
