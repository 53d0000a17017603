"""Every value a reply carries, for every strategy, plain and secure: wrong types, NaN, infinities, huge and
negative numbers, lists where a number belongs. Each bad value is refused with a reason naming its key (the member
alone in the clear; under SecAgg+ its group's aggregate, which holds its update), or accepted as a typed value in
its bounds; either way the round's rows are built and written (nothing downstream converts a reply's string)."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
from test_transport_plain import START, InMemoryGrid

from common.core_sections import MODULUS_RANGE, SecAggSection
from common.records import ReplyError, metrics_reply, train_reply
from common.reply_checks import EVAL_METRICS, EVAL_OPTIONAL, Bound, ListOf
from server_app.evaluation import evaluate_round
from server_app.rundir import RunDirectory
from server_app.secure import _check_secure_replies
from server_app.secure_weights import Unmasked
from server_app.training import reply_limits, train_rows
from server_app.transport import train_groups_plain
from strategies import REGISTRY, load_run_config
from strategies.base import Group, GroupResult

HONEST = {"train_loss": 1.0, "train_tokens": 10, "train_seconds": 1.0, "tokens_per_second": 10.0}
HONEST_EVAL = {"eval_loss": 2.0, "exact_match": 0.5, "rouge_l": 0.5, "eval_examples": 4, "eval_generated": 4}
pytestmark = pytest.mark.usefixtures("task_identity")  # Messages built outside an app (conftest)
BAD = ["x", "", "1,nan", "1e999", float("nan"), float("inf"), -float("inf"), -1, -1e300, 1e300, 10**30, True, [1.5]]


def honest(partition: int) -> dict:
    return {**HONEST, "partition-id": partition}


def in_bounds(value, spec) -> bool:
    """A typed value ``spec`` allows (what an accepted reply must have become)."""
    values = value if isinstance(spec, ListOf) else [value]
    if isinstance(spec, ListOf) and not isinstance(value, list):
        return False
    for v in values:
        if isinstance(v, bool) or not isinstance(v, spec.kind) or not math.isfinite(v):
            return False
        if (spec.low is not None and v < spec.low) or (spec.high is not None and v > spec.high):
            return False
    return True


def write_rows(tmp_path, results, extra) -> list:
    """The round's train rows, written as the ServerApp writes them (strict JSON: no NaN)."""
    rows = train_rows(results, 0.0, extra)
    RunDirectory(tmp_path).append_metrics([{"round": 1, "node": n, **r} for n, r in rows.items()])
    for line in (tmp_path / "metrics.jsonl").read_text().splitlines():
        json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} written to metrics.jsonl"))
    return rows


def cases():
    for name in REGISTRY:
        cfg = load_run_config({"strategy": name})
        limits = reply_limits(cfg)
        specs = {**limits.train_metrics, **limits.optional_metrics}
        for key, spec in specs.items():
            yield pytest.param(name, key, spec, id=f"{name}-{key}")


def extra_of(name: str) -> dict:
    from common.adapters import adapter_kind
    from strategies import strategy_spec

    cfg = load_run_config({"strategy": name})
    return {**adapter_kind(cfg.adapter).reply_metrics, **strategy_spec(name).server.reply_metrics}


@pytest.mark.parametrize(("name", "key", "spec"), list(cases()))
def test_plain_every_bad_value_of_every_reply_key_costs_only_its_sender(name, key, spec, tmp_path):
    limits = reply_limits(load_run_config({"strategy": name}))
    for n, value in enumerate(BAD):
        behaviour = {
            1: lambda a: train_reply({k: v + 1.0 for k, v in a.items()}, 10, honest(0)),
            2: lambda a, value=value: train_reply({k: v + 2.0 for k, v in a.items()}, 10, {**honest(1), key: value}),
        }
        group = Group("all", {nid: START for nid in behaviour})
        (result,) = train_groups_plain(InMemoryGrid(behaviour), 1, [group], 1.0, limits)
        assert 1 in result.contributors, (key, value)  # the honest member is never the one to pay
        if 2 in result.rejected:
            assert f"'{key}'" in result.rejected[2], (key, value, result.rejected[2])
        else:
            assert in_bounds(result.metrics[2][key], spec), (key, value, result.metrics[2][key])
        write_rows(tmp_path / str(n), [result], extra_of(name))


@pytest.mark.parametrize(("name", "key", "spec"), list(cases()))
def test_secure_every_bad_value_of_every_reply_key_refuses_the_aggregate_naming_it(name, key, spec, tmp_path):
    cfg = load_run_config({"strategy": name})
    limits, secagg = reply_limits(cfg), SecAggSection()
    cap = 10.0
    for n, value in enumerate(BAD):
        members = {1: {**honest(0), "num_examples": 10}, 2: {**honest(1), "num_examples": 10}}
        members[3] = {**honest(2), key: value, "num_examples": 10}
        total = sum(round(m["num_examples"] / cap * secagg.quantization_range) for m in members.values())
        result = GroupResult("all", None, 0.0, [1, 2, 3], metrics=members)
        try:
            _check_secure_replies(result, Unmasked(weights=[total % MODULUS_RANGE]), cap, secagg, limits)
        except ReplyError as err:
            assert "node(s) 3" in str(err) and f"'{key}'" in result.rejected[3], (key, value)
            result.contributors, result.aggregate_rejected = [], str(err)
        else:
            assert in_bounds(result.metrics[3][key], spec), (key, value, result.metrics[3][key])
        write_rows(tmp_path / str(n), [result], extra_of(name))


@pytest.mark.parametrize("key", sorted({**EVAL_METRICS, **EVAL_OPTIONAL}))
def test_every_bad_value_of_every_eval_reply_key_costs_only_that_nodes_row(key, tmp_path):
    spec = {**EVAL_METRICS, **EVAL_OPTIONAL}[key]
    cfg = load_run_config({"strategy": "fedavg", "eval.max-examples": 4})
    strategy = SimpleNamespace(eval_arrays=lambda nid: START, eval_config=lambda nid: None)
    for n, value in enumerate(BAD):
        behaviour = {
            1: lambda content: metrics_reply({**HONEST_EVAL, "partition-id": 0}),
            2: lambda content, value=value: metrics_reply({**HONEST_EVAL, "partition-id": 1, key: value}),
        }
        run = RunDirectory(tmp_path / str(n))
        evaluate_round(InMemoryGrid(behaviour), cfg, strategy, run, 1, [1, 2], {}, 0.0, {1: 0, 2: 1})
        rows = [json.loads(line) for line in run.metrics_path.read_text().splitlines()]
        by_node = {r["node"]: r for r in rows}
        assert by_node[1]["eval_loss"] == 2.0
        if by_node[2].get("eval_error"):
            assert f"'{key}'" in by_node[2]["eval_error"], (key, value)
        elif key in by_node[2]:
            assert in_bounds(by_node[2][key.replace("-", "_")], spec) or isinstance(spec, Bound) is False, (key, value)
        assert by_node[None]["eval_loss"] is not None and np.isfinite(by_node[None]["eval_loss"])


HUGE = ["x" * 20_000_006, ["n"] * 1_000_000, [[1.0]], b"bytes", *BAD]


@pytest.mark.parametrize("key", ["tasks", "layer_names", "salience", "anything"])
def test_every_bad_value_of_a_report_key_costs_only_that_nodes_report(key):
    """A strategy report's metrics are held to the same bounds as a reply's before the strategy reads them: a
    20,000,006-character string, a million-element list, a nested list, bytes or NaN is refused naming its key, and
    only its sender's report is left out."""
    from common.records import report_reply
    from server_app.transport import collect_reports

    for value in HUGE:
        behaviour = {
            1: lambda content: report_reply({"sig": np.ones(3, np.float32)}, {"tasks": "qa", "partition-id": 0}),
            2: lambda content, value=value: report_reply({"sig": np.ones(3, np.float32)}, {key: value}),
        }
        try:
            behaviour[2](None)
        except (TypeError, ValueError):  # Flower's ConfigRecord refuses it before it is ever sent
            continue
        reports, rejected, _ = collect_reports(InMemoryGrid(behaviour), 1, [1, 2], lambda a, m: m, 1.0)
        assert reports[1]["tasks"] == "qa", value
        if 2 in rejected:
            assert f"'{key}'" in rejected[2], (key, str(value)[:40], rejected[2])
        else:  # accepted: within every bound a reply is held to
            text = reports[2][key]
            assert len(text) <= 4096 if isinstance(text, str) else True


def test_an_atlas_fingerprint_naming_more_layers_than_its_model_has_is_refused():
    from common.records import report_reply
    from server_app.transport import collect_reports
    from strategies import strategy_spec
    from strategies.base import ClientInfo
    from strategies.fingerprint.wire import FINGERPRINT, LAYER_IMPORTANCE, LAYER_NAMES

    cfg = load_run_config({"strategy": "atlas"})
    strategy = strategy_spec("atlas").server.from_config(cfg)
    strategy.initialise({n: ClientInfo(n, n, "smol", START) for n in (1, 2, 3)})

    def report(layers: int, tasks: str = "qa"):
        metrics = {LAYER_NAMES: [f"l{i}" for i in range(layers)], LAYER_IMPORTANCE: [1.0] * layers}
        return report_reply({FINGERPRINT: np.ones(8, np.float32)}, {**metrics, "model": "smol", "tasks": tasks})

    behaviour = {1: lambda c: report(2), 2: lambda c: report(3), 3: lambda c: report(2, "y" * 5000)}
    reports, rejected, _ = collect_reports(InMemoryGrid(behaviour), 1, [1, 2, 3], strategy.read_report, 1.0)
    assert list(reports) == [1]
    assert "3 layers, more than the 2 arrays" in rejected[2], rejected
    assert "'tasks'" in rejected[3], rejected
