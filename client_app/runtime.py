"""What a client process keeps between messages: base models (each loaded once), their adapters, the data.

In simulation, Ray actors are long-lived, so one process serves many rounds and many virtual clients; in
deployment the node's model worker does. A base model is cached per (model, quantisation, device, CPU packing),
the adapter of the run's kind and settings is attached on top of it (``LoadedModel.attach``), the data is cached
per partition, and per-client state lives in the client's ``ClientState`` (``context.state``). ``model_loads``
counts how often this process really loaded a base model; clients report it so tests (and users) can see that it
stays at 1.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from flwr.app import Context

from common.adapters import AdapterKind, ClientState, adapter_kind
from common.config import RunConfig, TrainSection
from common.data import ClientData, DataError, Example, load_client_data
from common.data.node import ALLOW_PATHS_KEY, run_config_paths_allowed
from common.logs import get_logger
from common.messages import Identity
from common.model import load_base_model, load_tokenizer
from common.node_config import node_settings
from common.training import token_counts
from strategies import StrategyClient, load_run_config, strategy_spec

from .kept_evaluation import keeps_evaluation
from .state_store import in_simulation

log = get_logger("tessera.client")

_MODELS: dict[tuple, LoadedModel] = {}  # base models by what defines them: (name, quantisation, device, packing)
_DATA: dict[tuple, ClientData] = {}
# token counts of a larger client are estimated from this many of its examples (evenly spaced): start-up, not a cost
TOKEN_COUNT_LIMIT = 20_000
model_loads = 0
model_load_seconds = 0.0
# This message's start-up: seconds before the handler ran (a fresh ClientApp process) + until its model was ready.
_startup = {"spawn": 0.0, "began": 0.0, "ready": 0.0}
# partition -> digest of the client state this process read back from the node's disk (state_store), if it did
_restored: dict[int, str] = {}
# The run config this message validated, beside the Flower run config it came from (``run_config``).
_validated: dict[str, Any] = {}


def begin_message(spawn_seconds: float) -> None:
    _startup.update(spawn=spawn_seconds, began=time.perf_counter(), ready=0.0)
    _validated.clear()  # each message validates its run config afresh (a plug-in may have registered since)


def run_config(context: Context) -> RunConfig:
    """The run config of ``context``, validated once per message: the state keys (``declared_state_keys``) and the
    runtime (``get_runtime``) read the same validated object; another run config is validated anew."""
    flat = dict(context.run_config)
    if _validated.get("flat") != flat:
        cfg = load_run_config(flat)
        _validated.update(flat=flat, cfg=cfg)
    return _validated["cfg"]


def note_restored(context: Context, digest: str) -> None:
    """The client found its state on the node's disk (``state_store``): reported as ``state-restored`` from now on
    (a digest of the bytes read, so a test can hold it against the file the node wrote before it went down)."""
    if digest:
        _restored[node_settings(context.node_config).partition_id] = digest


@dataclass
class LoadedModel:
    """One frozen base model in this process and the adapter attached to it now (None: the pure base).

    Clients whose adapter settings differ (another kind, rank or expert set) share the base: the attached adapter
    is swapped (detached, the other attached: module surgery, no reload); their own weights live in their
    ``ClientState`` or arrive from the server with every message.
    """

    name: str
    base: Any
    tokenizer: Any
    last_run: int
    adapter: AdapterKind | None = None
    settings: str = ""

    @property
    def model(self) -> Any:
        return self.adapter.model if self.adapter is not None else self.base

    def attach(self, kind: type[AdapterKind], cfg: RunConfig) -> AdapterKind:
        """The adapter of ``kind`` with ``cfg``'s settings, attached (the one attached now, if it is that)."""
        wanted = f"{kind.name} {kind.settings(cfg)}"
        if self.adapter is None or self.settings != wanted:
            if self.adapter is not None:
                self.base = self.adapter.detach()
                self.adapter = None
            self.adapter, self.settings = kind(self.base, cfg), wanted
        return self.adapter


@dataclass
class ClientRuntime:
    """Everything one virtual client needs for a message: its config, the shared model, its data split, its
    strategy's client half and its kept state. A strategy's client half sees it only through the small protocol
    ``strategies.client.ClientRuntime`` (mypy checks that this class satisfies it)."""

    cfg: RunConfig
    loaded: LoadedModel
    adapter: AdapterKind  # attached to ``loaded``: the frozen (4-bit) base with this run's adapter
    strategy: StrategyClient
    state: ClientState
    partition_id: int
    run_id: int
    node_config: dict[str, Any]
    data: ClientData  # its training and held-out examples, and the counts it reports about them

    @property
    def train(self) -> list[Example]:
        return self.data.train

    @property
    def keeps_evaluation(self) -> bool:
        """Whether its evaluation and split counts stay on its node (``client_app.kept_evaluation``)."""
        return keeps_evaluation(self.node_config, self.cfg)

    @property
    def tasks(self) -> str:
        """The task set it reports (its identity's ``tasks``; ``node-data`` on a node's own file)."""
        return self.data.tasks

    @property
    def test(self) -> list[Example]:
        """The held-out examples evaluation reports on (the test split, or the validation split when tuning)."""
        return self.data.held_out

    @property
    def validation(self) -> list[Example]:
        """Its validation split (never trained on, not what evaluation reports unless tuning): the guard's."""
        return self.data.validation

    @property
    def model(self) -> Any:
        return self.adapter.model

    @property
    def tokenizer(self) -> Any:
        return self.loaded.tokenizer

    @property
    def model_name(self) -> str:
        return self.loaded.name

    def reattach(self, cfg: RunConfig) -> None:
        """Use this message's adapter settings (e.g. ATLAS's per-client ranks): the run's adapter kind attached
        with ``cfg`` (module surgery on the shared base only when the settings differ from what is attached)."""
        self.cfg = cfg
        self.adapter = self.loaded.attach(adapter_kind(strategy_spec(cfg.strategy).adapter_for(cfg)), cfg)

    def probe(self, name: str) -> LoadedModel:
        """A frozen probe model (e.g. SimGrad's signatures): the base model ``name``, loaded once like any other.
        When an adapter is attached to it (it is some client's base model), run it inside ``adapter.disabled()``."""
        return load_model(name, self.cfg, self.run_id)

    def identity(self) -> dict[str, Any]:
        """Who answered: reported beside every metric."""
        import resource

        identity = Identity(
            partition_id=self.partition_id,
            tasks=self.data.tasks,
            model=self.model_name,
            pid=os.getpid(),
            model_loads=model_loads,
            model_load_seconds=model_load_seconds,
            peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            startup_seconds=_startup["spawn"] + _startup["ready"],
            ray_node=_ray_node(),
            state_restored=_restored.get(self.partition_id, ""),
            state_bytes=self.state.nbytes(),
        )
        counts = {} if self.keeps_evaluation else self.data.counts  # how many records it holds: kept with it
        return {**identity.wire(), **counts}


def _ray_node() -> str:
    """The Ray node this process runs on ("" outside Ray): where a simulation on a Ray cluster placed the client."""
    ray = sys.modules.get("ray")  # imported by Flower's Ray backend in its actors; never imported here
    if ray is None or not ray.is_initialized():
        return ""
    return str(ray.get_runtime_context().get_node_id())


def get_runtime(context: Context) -> ClientRuntime:
    cfg = run_config(context)
    spec = strategy_spec(cfg.strategy)
    node = node_settings(context.node_config)  # checked once, naming a bad key on the node
    partition_id, num_partitions = node.partition_id, node.num_partitions
    # A node's own setting wins; else the run's per-partition list; else the run's model.
    model_name = node.model or cfg.model_for_partition(partition_id)
    cfg = cfg.for_model(model_name)  # this model's own step sizes (model.overrides), where the run gives some
    loaded = load_model(model_name, cfg, context.run_id)
    adapter = loaded.attach(adapter_kind(spec.adapter_for(cfg)), cfg)
    data = client_data_for(cfg, context, partition_id, num_partitions, loaded)
    if _startup["began"]:
        _startup["ready"] = time.perf_counter() - _startup["began"]
    state = ClientState(context.state, spec.state_keys(cfg))
    client = spec.client(cfg)
    node_config = dict(context.node_config)
    return ClientRuntime(cfg, loaded, adapter, client, state, partition_id, context.run_id, node_config, data)


def client_data_for(
    cfg: RunConfig, context: Context, partition_id: int, num_partitions: int, loaded: LoadedModel
) -> ClientData:
    """This client's data, read once per process: the node's own (node-config ``data-path``), else its share of
    the run's bank. Bad data is refused here with the whole story in the node's log (file, row, fix) and only the
    reason in the error the server sees (no path, no text): a ``DataError``'s message, or for any other exception
    (an ``OSError`` names its path) only its kind. Outside simulation the run config may not name files on the node
    (``data.partition-sources``, a path in ``data.source``) unless node-config ``allow-run-config-paths`` is true."""
    node_data = {k: v for k, v in context.node_config.items() if str(k).startswith("data-") or k == ALLOW_PATHS_KEY}
    simulation = in_simulation()
    key = (
        cfg.data.model_dump_json(),
        tuple(sorted(node_data.items())),
        partition_id,
        num_partitions,
        cfg.seed,
        simulation,
    )
    if key not in _DATA:
        try:
            paths = run_config_paths_allowed(dict(context.node_config), simulation)
            data = load_client_data(cfg.data, partition_id, num_partitions, cfg.seed, dict(context.node_config), paths)
        except DataError as err:
            log.error("partition %d: its data cannot be used: %s", partition_id, err.detail)
            raise DataError(f"node data: {err}") from None
        except Exception as err:  # its message may hold the path or the text (PermissionError: the path)
            log.error(
                "partition %d: its data cannot be used: %s: %s", partition_id, type(err).__name__, err, exc_info=True
            )
            raise DataError(
                f"node data: the node's data could not be read ({type(err).__name__}); details are in the node's log"
            ) from None
        examples = data.train + data.held_out  # what it trains on and what it is evaluated on
        tokens, over, counted = token_counts(loaded.tokenizer, examples, cfg.train.max_seq_len, TOKEN_COUNT_LIMIT)
        data.counts.update({"data-tokens": tokens, "data-over-max-seq-len": over, "data-tokens-counted": counted})
        if data.own:
            log.info("partition %d: own data, %s", partition_id, data.counts)
        _DATA[key] = data
    return _DATA[key]


def declared_state_keys(context: Context) -> tuple[str, ...]:
    """The client-state keys the run's adapter kind and strategy keep (what a node's model worker carries back)."""
    cfg = run_config(context)
    return strategy_spec(cfg.strategy).state_keys(cfg)


def load_model(name: str, cfg: RunConfig, run_id: int) -> LoadedModel:
    """The base model ``name`` as ``cfg.model`` defines it, loaded once per process.

    Memory rule: before loading a base model, the ones no message of the current run has used are freed (a
    long-lived node worker serving a new run with another model gives the old one back; a run keeps every base
    model it uses: its clients' and its probe)."""
    key = (
        name,
        cfg.model.quantization,
        cfg.model.device,
        cfg.model.cpu_packed_inference,
        cfg.model.gradient_checkpointing,
    )
    if key not in _MODELS:
        stale = [k for k, m in _MODELS.items() if m.last_run != run_id]
        if stale:
            _free(stale)
        _MODELS[key] = LoadedModel(name, _load_base(name, cfg), load_tokenizer(name), run_id)
    loaded = _MODELS[key]
    loaded.last_run = run_id
    return loaded


def _free(keys: list[tuple]) -> None:
    import gc

    import torch

    for key in keys:
        log.info("process %d: freeing base model %s (no message of this run uses it)", os.getpid(), key[0])
        del _MODELS[key]
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _load_base(model_name: str, cfg: RunConfig):
    global model_loads, model_load_seconds
    _configure_process()
    log.info("process %d: loading base model %s (%s)", os.getpid(), model_name, cfg.model.quantization)
    started = time.perf_counter()
    m = cfg.model
    base = load_base_model(model_name, m.quantization, m.device, m.cpu_packed_inference, m.gradient_checkpointing)
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


def node_train_settings(settings: TrainSection, node_config: Mapping[str, Any]) -> TrainSection:
    """The run's training settings, with this node's memory budget: node-config ``max-micro-batch`` caps the
    slices a batch goes through in (the update stays the same; a smaller GPU just takes more passes)."""
    cap = node_settings(node_config).max_micro_batch
    if cap is None:
        return settings
    micro = min(settings.micro_batch_size or settings.batch_size, cap)
    return settings.model_copy(update={"micro_batch_size": micro})
