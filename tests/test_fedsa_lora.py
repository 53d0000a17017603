"""FedSA-LoRA (``strategy = "fedsa-lora"``): the server averages only the LoRA A matrices (example-weighted, per
model family, each family one SecAgg+ group of at least 3 in secure mode); each client keeps its B matrices in its
client state and never sends them; each client saves its whole adapter (global A + own B) at the end."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from child import SIMULATION_BACKEND, run_in_child
from flwr.app import Context, Message, MessageType, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.simulation import run_simulation

from common.adapters import ClientState
from common.config import SecAggSection
from common.messages import QUERY_INITIAL, QueryPart, RoundPart, read_train
from common.records import (
    FITRES_ARRAYS,
    eval_instruction,
    initial_reply,
    query_instruction,
    read_initial_reply,
    read_train_arrays,
    read_train_config,
    read_train_instruction,
    read_train_reply,
    train_instruction,
    train_reply,
)
from common.reply_checks import IDENTITY_METRICS, ReplyLimits
from strategies import ClientInfo, GroupResult, load_run_config, strategy_spec
from strategies.aggregation import secagg_error_bound, secagg_weights
from strategies.fedsa_lora import OWN_B, FedSALora, FedSALoraClient
from strategies.fedsa_lora.selective import merge, private_part, shared_part, split

LAYERS = ("base_model.model.l0.q_proj", "base_model.model.l1.v_proj")
A_NAMES = sorted(f"{layer}.lora_A.weight" for layer in LAYERS)
MAX_WEIGHT = 40  # members weigh 10, 20, 30 examples
LIMITS = ReplyLimits(examples_per_round=MAX_WEIGHT, train_metrics=IDENTITY_METRICS)


def adapter(seed: int = 0, width: int = 4) -> dict[str, np.ndarray]:
    """A whole LoRA as peft names it: A drawn from ``seed``, B zero (peft's init)."""
    rng = np.random.default_rng(seed)
    out = {}
    for layer in LAYERS:
        out[f"{layer}.lora_A.weight"] = rng.normal(size=(2, width)).astype(np.float32)
        out[f"{layer}.lora_B.weight"] = np.zeros((width, 2), np.float32)
    return out


def trained(partition: int, start: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A stand-in for local training: every array (A and B) moves by the partition's own step."""
    rng = np.random.default_rng(100 + partition)
    return {k: (v + rng.normal(scale=0.5, size=v.shape)).astype(np.float32) for k, v in sorted(start.items())}


def examples(partition: int) -> int:
    return 10 * (partition + 1)


def reference_mean(updates: list[dict[str, np.ndarray]], weights: list[float]) -> dict[str, np.ndarray]:
    """sum_i w_i A_i / sum_i w_i over the A matrices, written out in NumPy (the reference the server must match)."""
    w = np.asarray(weights, np.float64)
    return {k: np.tensordot(w, np.stack([u[k] for u in updates]).astype(np.float64), axes=1) / w.sum() for k in A_NAMES}


def test_the_split_sends_a_keeps_b_and_merge_refuses_a_mixed_up_adapter():
    whole = adapter()
    shared, private = split(whole)
    assert sorted(shared) == A_NAMES and all("lora_B" in k for k in private) and len(private) == len(LAYERS)
    assert shared == shared_part(whole) and private == private_part(whole)
    assert merge(shared, private, whole) == whole
    with pytest.raises(ValueError, match="extra.*lora_B"):  # a B among the A matrices (the server's side)
        merge(whole, private, whole)
    with pytest.raises(ValueError, match="B matrices differ.*missing"):
        merge(shared, {}, whole)
    with pytest.raises(ValueError, match="shape"):
        merge({k: v.T for k, v in shared.items()}, private, whole)
    with pytest.raises(ValueError, match="neither a LoRA A nor a LoRA B"):
        split({**whole, "base_model.model.l0.q_proj.magnitude": np.ones(4, np.float32)})


class AnswerGrid:
    """Stands in for the SuperLink: every train instruction is answered at once by ``answer(node, sent arrays)``."""

    def __init__(self, answer, reference: dict[str, np.ndarray]) -> None:
        self.answer, self.reference = answer, reference

    def send_and_receive(self, messages, *, timeout=None):
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = msg.object_id  # as Flower's grid does when it pushes
        return [
            Message(
                self.answer(m.metadata.dst_node_id, read_train_instruction(m.content, self.reference)[0]), reply_to=m
            )
            for m in messages
        ]


@pytest.mark.usefixtures("task_identity")
def test_the_server_averages_only_the_a_matrices_weighted_by_examples():
    """Four clients of one model: the group starts from (and returns) the A matrices alone; the new global A is the
    example-weighted mean of the members' A (a NumPy reference); the reply that carries B too (node 4) is refused,
    not averaged."""
    from server_app.transport import train_groups_plain

    strategy = FedSALora()
    strategy.initialise({n: ClientInfo(n, n - 1, "smol", adapter()) for n in (1, 2, 3, 4)})
    (group,) = strategy.train_groups(1, [1, 2, 3, 4])
    assert group.members == [1, 2, 3, 4] and all(sorted(start) == A_NAMES for start in group.start.values())
    sent: dict[int, dict] = {}

    def answer(node: int, arrays: dict) -> RecordDict:
        whole = trained(node - 1, merge(arrays, private_part(adapter()), adapter()))
        sent[node] = whole
        return train_reply(shared_part(whole) if node != 4 else whole, examples(node - 1), {"partition-id": node - 1})

    (result,) = train_groups_plain(AnswerGrid(answer, shared_part(adapter())), 1, [group], 1.0, LIMITS)
    assert result.contributors == [1, 2, 3] and "layout" in result.rejected[4]  # 32 numbers, expected 16
    strategy.update(1, [result])
    expected = reference_mean([sent[n] for n in (1, 2, 3)], [examples(p) for p in range(3)])
    new = strategy.eval_arrays(1)
    assert sorted(new) == A_NAMES and not any("lora_B" in k for k in strategy.state_dict()["global"])
    for key in A_NAMES:
        np.testing.assert_allclose(new[key], expected[key], rtol=0, atol=1e-6)
    unweighted = reference_mean([sent[n] for n in (1, 2, 3)], [1.0, 1.0, 1.0])
    assert max(np.abs(new[k] - unweighted[k]).max() for k in A_NAMES) > 1e-3  # the weights mattered
    assert strategy.final_adapters() == []  # an A alone is no adapter: the clients save theirs


def test_secure_fedsa_lora_refuses_a_family_of_two_before_round_one():
    """Each family is one SecAgg+ group (its A matrices' shapes depend on the model): a family of 2 would leak."""
    clients = {n: ClientInfo(n, n, "smol" if n < 3 else "qwen", adapter(width=4 if n < 3 else 6)) for n in range(5)}
    with pytest.raises(ValueError, match=r"\{'qwen': 2\}.*fewer than 3.*fedsa-lora"):
        FedSALora(secure=True).initialise(clients)
    plain = FedSALora(secure=False)
    plain.initialise(clients)  # plain mode averages a family of any size, each family on its own
    assert sorted(g.name for g in plain.train_groups(1, list(clients))) == ["qwen", "smol"]
    FedSALora(secure=True).initialise({n: c for n, c in clients.items() if n < 3})


def test_resume_restores_each_familys_global_a():
    def two_families() -> FedSALora:
        strategy = FedSALora()
        strategy.initialise(
            {n: ClientInfo(n, n, "smol" if n % 2 else "qwen/7b", adapter(width=4 + n % 2)) for n in (1, 2)}
        )
        return strategy

    strategy = two_families()
    strategy.update(1, [GroupResult("smol", {k: np.full((2, 5), 0.5, np.float32) for k in A_NAMES}, 8.0, [1])])
    state = strategy.state_dict()
    assert sorted(state) == ["global-qwen_2f_7b", "global-smol"] and all(sorted(a) == A_NAMES for a in state.values())
    resumed = two_families()
    resumed.load_state_dict(state)
    for nid in (1, 2):
        for key in A_NAMES:
            np.testing.assert_array_equal(resumed.eval_arrays(nid)[key], strategy.eval_arrays(nid)[key])
    with pytest.raises(ValueError, match="model family 'qwen_2f_7b'"):
        two_families().load_state_dict({"global-smol": state["global-smol"]})


def test_the_registry_entry_trains_lora_and_declares_the_kept_b():
    cfg = load_run_config({"strategy": "fedsa-lora", "lora.r": 4})
    spec = strategy_spec("fedsa-lora")
    assert cfg.adapter == "lora" and spec.server is FedSALora and spec.client is FedSALoraClient
    assert spec.state_keys(cfg) == (OWN_B,)
    import strategies.fedavg

    assert strategies.fedavg.family_key("org/model 7b") == "org_2f_model_20_7b"  # still importable from fedavg


# --- the client half on a real (tiny, random) model, through the ClientApp's own handlers ---------------------------


def client_context(tiny_llama_dir, run_dir: Path, partition: int, audit: Path) -> Context:
    run_config = {
        "strategy": "fedsa-lora",
        "model.name": str(tiny_llama_dir),
        "model.quantization": "fp32",
        "model.device": "cpu",
        "lora.r": 2,
        "num-server-rounds": 1,
        "train.local-steps": 2,
        "train.batch-size": 1,
        "train.learning-rate": 0.1,
        "eval.max-examples": 1,
        "eval.max-new-tokens": 2,
        "data.tasks": "boolq",
        "data.max-examples-per-task": 20,
        "run-dir": str(run_dir),
    }
    node_config = {"partition-id": partition, "num-partitions": 2, "audit-dir": str(audit)}
    return Context(run_id=1, node_id=partition + 1, node_config=node_config, state=RecordDict(), run_config=run_config)


@pytest.mark.usefixtures("task_identity")
def test_a_client_trains_a_and_b_sends_only_a_keeps_b_and_saves_its_whole_adapter(tiny_llama_dir, tmp_path):
    from peft import PeftModel, get_peft_model_state_dict

    from client_app.handlers import evaluate_handler, query, train
    from client_app.runtime import get_runtime
    from common.model import load_base_model

    audit, run_dir = tmp_path / "audit", tmp_path / "run"
    alice, bob = (client_context(tiny_llama_dir, run_dir, p, audit) for p in (0, 1))
    whole = get_runtime(alice).adapter.initial
    global_a = shared_part(whole)
    assert not any(np.any(b) for b in private_part(whole).values())  # peft's init: B = 0

    instruction = train_instruction(global_a, RoundPart(server_round=1).wire())
    reply = train(Message(instruction, dst_node_id=1, message_type=MessageType.TRAIN), alice)
    (packed,) = reply.content.array_records[FITRES_ARRAYS].values()
    assert packed.numpy().size == sum(a.size for a in global_a.values())  # the reply holds A's numbers, no more
    sent_a, weight, _ = read_train_reply(reply.content, global_a)
    assert weight == 2 and max(np.abs(sent_a[k] - global_a[k]).max() for k in global_a) > 0  # A trained
    kept = dict(np.load(audit / "round-1-partition-0.npz"))  # exactly what left the node, by name
    assert sorted(k for k in kept if k != "__weight__") == sorted(global_a)
    assert not any("lora_B" in k for k in kept)
    own_b = ClientState(alice.state, (OWN_B,)).get(OWN_B)
    assert sorted(own_b) == sorted(private_part(whole)) and max(np.abs(b).max() for b in own_b.values()) > 0

    # the initial query (answered before round 1, and to a node that rejoins) carries the seeded adapter: B = 0
    initial = query(
        Message(query_instruction(0, QueryPart(query=QUERY_INITIAL)), dst_node_id=1, message_type=MessageType.QUERY),
        alice,
    )
    assert not any(np.any(b) for b in private_part(read_initial_reply(initial.content)[0]).values())

    # bob shares the process and the model: he starts from the initial B, not from alice's
    rt = get_runtime(bob)
    assert not any(np.any(v) for k, v in rt.strategy.start(rt, global_a).items() if k in own_b)

    # the last round's evaluation: global A + her own B, saved as her PEFT directory; the reply holds no arrays
    new_a = {k: (v + 0.01).astype(np.float32) for k, v in sent_a.items()}
    message = Message(
        eval_instruction(new_a, RoundPart(server_round=1).wire()), dst_node_id=1, message_type=MessageType.EVALUATE
    )
    metrics_reply = evaluate_handler(message, alice)
    assert len(metrics_reply.content.array_records) == 0
    saved = run_dir / "client-adapters" / "partition-0"
    sent = dict(metrics_reply.content.config_records["metrics"])
    assert "adapter_dir" not in sent and not any(str(tmp_path) in str(v) for v in sent.values())  # the node's paths
    assert (saved / "adapter_config.json").exists()
    base = load_base_model(str(tiny_llama_dir), "fp32", "cpu")
    loaded = {k: v.numpy() for k, v in get_peft_model_state_dict(PeftModel.from_pretrained(base, str(saved))).items()}
    assert sorted(loaded) == sorted(whole)
    for key in new_a:
        np.testing.assert_array_equal(loaded[key], new_a[key])
    for key in own_b:
        np.testing.assert_array_equal(loaded[key], own_b[key])
    assert not (run_dir / "adapter").exists()


# --- plain and SecAgg+ through the transport (Flower's simulation in a child process; synthetic training) -----------


def run_both_modes(tmp_path: Path) -> dict:
    run_in_child("test_fedsa_lora", "both_modes_in_process", str(tmp_path))
    return json.loads((tmp_path / "result.json").read_text())


def both_modes_in_process(tmp_path: str) -> None:
    """Three clients answer the initial query with a whole LoRA and train with FedSA-LoRA's client half (A and B
    move, see ``trained``); the server runs round 1 of FedSA-LoRA in the clear, then again from the same global A
    through SecAgg+. Each client writes the B it keeps after every message."""
    from client_app.app import secure_aggregation_mod
    from server_app.secure import train_groups_secure
    from server_app.transport import query_clients, train_groups_plain, wait_for_nodes

    out = Path(tmp_path)
    client = ClientApp(mods=[secure_aggregation_mod])
    half = FedSALoraClient(load_run_config({"strategy": "fedsa-lora"}))

    @client.query()
    def query(msg: Message, context: Context) -> Message:
        identity = {"partition-id": int(context.node_config["partition-id"]), "model": "smol"}
        return Message(initial_reply(adapter(), identity), reply_to=msg)

    @client.train()
    def train(msg: Message, context: Context) -> Message:
        partition = int(context.node_config["partition-id"])
        rt = SimpleNamespace(adapter=SimpleNamespace(initial=adapter()), state=ClientState(context.state, (OWN_B,)))
        instruction = read_train(read_train_config(msg.content), None)
        start = half.start(rt, read_train_arrays(msg.content, half.wire_reference(rt, None)))
        sent, _ = half.outgoing(rt, trained(partition, start))
        messages = len(list(out.glob(f"b-{partition}-*.npz")))
        np.savez(out / f"b-{partition}-{messages + 1}.npz", **rt.state.get(OWN_B))
        cap = instruction.secagg.max_weight if instruction.secagg is not None else MAX_WEIGHT
        weight = min(examples(partition), int(cap))
        return Message(train_reply(sent, weight, {"partition-id": partition}), reply_to=msg)

    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        nodes = wait_for_nodes(grid, 3, timeout=120)
        clients = query_clients(grid, nodes, 60)
        result = {}
        for secure in (False, True):
            strategy = FedSALora(secure=secure)
            strategy.initialise(clients)
            groups = strategy.train_groups(1, nodes)
            if secure:
                results = train_groups_secure(grid, context, 1, groups, SecAggSection(), LIMITS)
            else:
                results = train_groups_plain(grid, 1, groups, 60, LIMITS)
            strategy.update(1, results)
            result["secure" if secure else "plain"] = {
                "contributors": sorted(clients[n].partition_id for n in results[0].contributors),
                "global": {k: v.tolist() for k, v in strategy.state_dict()["global"].items()},
            }
        (out / "result.json").write_text(json.dumps(result))

    run_simulation(server_app=server, client_app=client, num_supernodes=3, backend_config=SIMULATION_BACKEND)


def test_plain_and_secure_rounds_average_the_same_a_and_b_stays_with_each_client(tmp_path):
    out = run_both_modes(tmp_path)
    start = merge(shared_part(adapter()), private_part(adapter()), adapter())
    updates = [trained(p, start) for p in range(3)]
    weights = secagg_weights([examples(p) for p in range(3)], MAX_WEIGHT)
    expected = reference_mean(updates, weights)
    bound = secagg_error_bound(weights, SecAggSection().clipping_range, SecAggSection().quantization_range)
    plain, secure = ({k: np.asarray(v) for k, v in out[m]["global"].items()} for m in ("plain", "secure"))
    assert out["plain"]["contributors"] == out["secure"]["contributors"] == [0, 1, 2]
    assert sorted(plain) == sorted(secure) == A_NAMES  # only A reached the server, in both modes
    for key in A_NAMES:
        assert np.abs(plain[key] - expected[key]).max() <= 1e-6, key
        assert np.abs(secure[key] - plain[key]).max() <= bound + 1e-6, key
    for p in range(3):  # each client's B moved with its own training, kept between messages, never averaged
        first, second = (dict(np.load(tmp_path / f"b-{p}-{m}.npz")) for m in (1, 2))
        step = private_part(trained(p, start))
        for key, value in step.items():
            np.testing.assert_allclose(first[key], value, atol=1e-6)
            np.testing.assert_allclose(second[key], 2 * value, atol=1e-5)  # the second message started from it


# --- the whole system: real ServerApp and ClientApp (in-process simulation, tiny model) ------------------------------


@pytest.mark.e2e
@pytest.mark.parametrize("secure", [False, True])
def test_a_fedsa_lora_federation_shares_a_and_each_client_saves_its_own_b(tiny_llama_dir, tmp_path, secure):
    """Train replies are A's size, the server's state holds A only and it saves no adapter; the clients' loss
    falls; each client's PEFT directory holds the final global A and a B of its own."""
    from safetensors.numpy import load_file
    from test_toy_strategy import config, run

    from server_app.rundir import RunDirectory

    run_dir = tmp_path / "run"
    run(config(tiny_llama_dir, run_dir, **{"strategy": "fedsa-lora", "lora.r": 2, "secure": secure}))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["node"] is not None]
    _, state = RunDirectory(run_dir).load_checkpoint()
    (final_a,) = state.values()
    assert final_a and all(".lora_A." in k for k in final_a)
    a_bytes = sum(v.nbytes for v in final_a.values())
    trained = [r for r in rows if r["round"] > 0]
    assert len(trained) == 6 and all(r["accepted"] for r in trained)
    if not secure:  # measured on the wire (secure mode reports the reference size: SecAgg+ sends masked vectors)
        assert all(r["bytes_up"] == a_bytes for r in trained), trained
    loss = {(r["partition_id"], r["round"]): r["eval_loss"] for r in rows}
    assert sum(loss[p, 2] for p in range(3)) < sum(loss[p, 0] for p in range(3)), loss  # 1 example each: noisy
    assert not (run_dir / "adapter").exists() and not (run_dir / "adapters").exists()
    saved = [
        load_file(str(run_dir / "client-adapters" / f"partition-{p}" / "adapter_model.safetensors")) for p in range(3)
    ]
    for own in saved:
        for key, value in final_a.items():
            np.testing.assert_array_equal(own[key], value)
    b_names = sorted(set(saved[0]) - set(final_a))
    assert b_names and all(".lora_B." in k for k in b_names)
    assert all(not np.array_equal(saved[0][k], saved[1][k]) for k in b_names)  # each client's own B
