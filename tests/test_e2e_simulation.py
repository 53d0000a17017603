"""End to end: `flwr run . local` (Flower's managed SuperLink, Ray) with the real 4-bit SmolLM2, 3 clients with
distinct tasks, 2 rounds; plain and SecAgg+; resume; an invalid config failing fast. Minutes each."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from common.config import SecAggSection
from deploy.local_sim import ROOT, flwr_env, flwr_run, prepare_home, stop_superlink
from strategies.aggregation import secagg_error_bound

pytestmark = pytest.mark.e2e

# Small but real: every client trains 4 steps per round and evaluates 6 held-out examples.
FAST = "train.local-steps=4 eval.max-examples=6 eval.max-new-tokens=8"


@pytest.fixture(scope="module")
def flwr_home(tmp_path_factory):
    home = prepare_home(tmp_path_factory.mktemp("flwr-home"))
    yield home
    stop_superlink(home)


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def per_client(rows: list[dict], server_round: int) -> dict[int, dict]:
    """A round's client rows keyed by partition id (node ids are new after a resume, partitions are not)."""
    return {r["partition_id"]: r for r in rows if r["round"] == server_round and r["node"] is not None}


def assert_every_client_improved(rows: list[dict], last_round: int) -> None:
    first, last = per_client(rows, 0), per_client(rows, last_round)
    assert len(first) == 3 and set(first) == set(last)
    for partition, row in first.items():
        assert last[partition]["eval_loss"] < row["eval_loss"], (
            f"client {row['partition_id']} ({row['tasks']}): loss did not fall"
        )
    assert len({row["tasks"] for row in first.values()}) == 3  # three distinct task mixes


def global_adapter(run_dir: Path) -> dict[str, np.ndarray]:
    """The global adapter of the run's last checkpointed round."""
    from server_app.rundir import RunDirectory

    loaded = RunDirectory(run_dir).load_checkpoint()
    assert loaded is not None, f"no checkpoint in {run_dir}"
    return loaded[1]["global"]


@pytest.fixture(scope="module")
def plain_run(flwr_home, tmp_path_factory):
    """Two plain rounds, run as one round and a resumed second, keeping the round-1 global adapter (the secure
    test compares its own round 1 with it) and the rows before the resume (the resume test reads them)."""
    run_dir = tmp_path_factory.mktemp("plain") / "run"
    proc = flwr_run(flwr_home, f"{FAST} num-server-rounds=1 run-dir='{run_dir}'")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    round_one, before_resume = global_adapter(run_dir), read_metrics(run_dir)
    proc = flwr_run(flwr_home, f"{FAST} num-server-rounds=2 resume=true run-dir='{run_dir}'")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return run_dir, proc, round_one, before_resume


def test_fedavg_plain_trains_every_client_and_saves_a_loadable_adapter(plain_run):
    run_dir, proc, _, _ = plain_run
    rows = read_metrics(run_dir)
    assert sorted({r["round"] for r in rows}) == [0, 1, 2]
    assert_every_client_improved(rows, 2)
    for row in rows:
        for key in ("round", "node", "eval_loss", "exact_match", "rouge_l", "bytes_up", "bytes_down", "seconds"):
            assert key in row, key
    trained = per_client(rows, 1)
    assert all(r["bytes_up"] > 0 and r["bytes_down"] > 0 and r["accepted"] for r in trained.values())
    # the base model was loaded once per client process, however many rounds and virtual clients it served
    loads: dict[int, int] = {}
    for row in rows:
        if row["node"] is not None:
            loads[row["pid"]] = max(loads.get(row["pid"], 0), row["model_loads"])
    assert loads and set(loads.values()) == {1}
    assert (run_dir / "eval_loss.png").stat().st_size > 1000
    assert str(run_dir / "metrics.jsonl") in proc.stdout + proc.stderr

    # the saved adapter is a PEFT adapter directory on top of the real 4-bit base, holding the final global weights
    from peft import PeftModel, get_peft_model_state_dict

    from common.model import load_base_model

    model = PeftModel.from_pretrained(load_base_model("smollm2-135m-instruct", "nf4", "cpu"), str(run_dir / "adapter"))
    loaded = {k: v.float().numpy() for k, v in get_peft_model_state_dict(model).items()}
    saved = global_adapter(run_dir)
    assert set(loaded) == set(saved)
    for key, value in loaded.items():
        np.testing.assert_allclose(value, saved[key], rtol=0, atol=1e-6)
    assert any(np.abs(v).max() > 0 for k, v in loaded.items() if "lora_B" in k)  # B moved off its zero init


def test_resume_continues_after_the_last_completed_round(plain_run):
    """The fixture's second `flwr run` (resume=true, 2 rounds) after its first (1 round): no run of its own."""
    run_dir, proc, _, before = plain_run
    assert "resuming after round 1" in proc.stdout + proc.stderr, proc.stdout[-3000:]
    after = read_metrics(run_dir)
    assert after[: len(before)] == before  # earlier rounds untouched, round 0 not re-run
    assert [r["round"] for r in after[len(before) :]] == [2] * 4  # one new round: 3 clients + aggregate
    assert json.loads((run_dir / "checkpoint" / "state.json").read_text())["round"] == 2
    # the live curves, as TensorBoard reads them: every client's held-out loss at each round once, 0 and 1 from
    # before the resume
    curves = client_loss_curves(run_dir)
    assert len(curves) == 3 and all(steps == [0, 1, 2] for steps in curves.values()), curves


def client_loss_curves(run_dir: Path) -> dict[str, list[int]]:
    """client/<partition> -> the rounds of its eval_loss curve, read by TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0}).Reload()
    return {
        tag.rsplit("/", 1)[0]: [e.step for e in board.Scalars(tag)]
        for tag in board.Tags()["scalars"]
        if tag.startswith("client/") and tag.endswith("/eval_loss")
    }


def last_round(run_dir: Path) -> int:
    """The last round with rows in a running run's metrics.jsonl (-1 before round 0's; a line being written is
    not read)."""
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().split("\n")[:-1] if path.exists() else []  # whole lines end with a newline
    return max((json.loads(line)["round"] for line in lines if line.strip()), default=-1)


def test_an_operator_sees_each_round_on_the_board_while_the_next_one_trains(flwr_home, tmp_path):
    """A 3-client, 3-round run watched as it goes: as soon as round 1's (then 2's) rows are in metrics.jsonl, and
    before the next round's are, TensorBoard's reader finds that round's held-out loss for every client."""
    run_dir, finished = tmp_path / "run", {}

    def run() -> None:
        finished["proc"] = flwr_run(flwr_home, f"{FAST} num-server-rounds=3 run-dir='{run_dir}'")

    thread = threading.Thread(target=run)
    thread.start()
    seen: dict[int, dict[str, list[int]]] = {}
    while thread.is_alive():
        done = last_round(run_dir)
        if done in (1, 2) and done not in seen:
            curves = client_loss_curves(run_dir)
            if last_round(run_dir) == done:  # the next round still going
                seen[done] = curves
        time.sleep(0.2)
    thread.join()
    assert finished["proc"].returncode == 0, finished["proc"].stderr[-3000:]
    assert sorted(seen) == [1, 2], "the run was not caught between rounds"
    for done, curves in seen.items():
        assert len(curves) == 3 and all(steps == list(range(done + 1)) for steps in curves.values()), curves


def test_fedavg_secure_matches_plain(plain_run, flwr_home, tmp_path):
    run_dir = tmp_path / "secure"
    # One round with the plain run's seeds, data and learning rate (num-server-rounds only shapes the cosine decay,
    # which starts at the full rate in round 1 either way): the members' updates are the plain run's.
    proc = flwr_run(flwr_home, f"{FAST} num-server-rounds=1 secure=true min-train-replies=3 run-dir='{run_dir}'")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "SecAgg+" in proc.stdout + proc.stderr
    rows = read_metrics(run_dir)
    assert_every_client_improved(rows, 1)
    # The aggregate equals the plain one up to SecAgg+'s quantisation. Every member trained the same number of
    # examples, so each weight is 1 (max_weight = examples per round). Held-out losses are not compared: on a CPU
    # with AVX512-BF16 evaluation runs the packed bf16 kernel, where a difference of one quantisation step can
    # flip roundings and move a 6-example loss by a few hundredths.
    secure, plain = global_adapter(run_dir), plain_run[2]
    assert secure.keys() == plain.keys()
    bound = secagg_error_bound([1.0, 1.0, 1.0], SecAggSection().clipping_range, SecAggSection().quantization_range)
    worst = max(float(np.abs(secure[k] - plain[k]).max()) for k in plain)
    assert worst <= bound, (worst, bound)
    assert max(float(np.abs(plain[k]).max()) for k in plain if "lora_B" in k) > 100 * bound  # a real update


def test_sublora_fedavg_through_secagg_sends_d_numbers_and_every_client_learns(flwr_home, tmp_path):
    """SubLoRA end to end: clients (d = 1,000) averaged by FedAvg through SecAgg+ on the real model."""
    run_dir = tmp_path / "sublora"
    # the bound on 8 training examples per client (two forward passes each at the last round; 64 by default)
    overrides = "fedavg.adapter='sublora' sublora.intrinsic-dim=1000 sublora.bound-examples=8 secure=true "
    overrides += "min-train-replies=3"
    proc = flwr_run(flwr_home, f"{FAST} num-server-rounds=1 {overrides} run-dir='{run_dir}'")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "SecAgg+" in proc.stdout + proc.stderr
    rows = read_metrics(run_dir)
    assert_every_client_improved(rows, 1)
    last = per_client(rows, 1)
    assert all(r["bytes_up"] == 4 * 1000 and r["accepted"] for r in last.values())  # alpha only: d float32s
    for row in last.values():  # the bound, from each client's own training data
        assert row["bound_code_bits"] < row["bound_raw_bits"] and row["bound_examples"] > 0
        assert row["bound_bits_per_token"] > row["bound_train_bits_per_token"] > 0
        exported = run_dir / "client-adapters" / f"partition-{row['partition_id']}"
        assert (exported / "adapter_model.safetensors").exists()  # theta_0 + P alpha, as a PEFT adapter
    assert np.any(global_adapter(run_dir)["alpha"])


def test_invalid_config_fails_before_round_one_naming_the_key(flwr_home, tmp_path):
    run_dir = tmp_path / "bad"
    proc = flwr_run(flwr_home, f"train.local-steps=0 run-dir='{run_dir}'", timeout=300)
    output = proc.stdout + proc.stderr
    assert "train.local-steps" in output and "greater than or equal to 1" in output, output[-3000:]
    # `flwr run` exits 0 here; the SuperLink's record of the run says it failed, and so does the exit code
    assert proc.returncode == 1 and "finished:failed: Simulation failed" in proc.stderr, output[-3000:]
    # before round 1: no client was asked anything, no round was evaluated, nothing was written
    assert "clients:" not in output and "round 0:" not in output, output[-3000:]
    assert not run_dir.exists()


def test_the_demo_script_exits_non_zero_naming_the_key_when_its_run_is_refused(tmp_path):
    """`flwr run` exits 0 when the ServerApp refuses its run config; scripts/demo.sh asks the SuperLink how the run
    ended (deploy.outcome) and fails with the reason."""
    home = prepare_home(tmp_path / "home")  # its own SuperLink: the demo stops the one of its home when it ends
    done = subprocess.run(
        ["bash", "scripts/demo.sh", "num-server-rounds=-1"],
        cwd=ROOT,
        env=flwr_env(home),
        capture_output=True,
        text=True,
        timeout=900,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 1, out[-3000:]
    assert "num-server-rounds" in out and "finished:failed" in out, out[-3000:]


def test_partition_sources_simulate_members_own_files_and_bad_data_leaves_its_node_out(flwr_home, tmp_path):
    """``data.partition-sources``: each simulated node reads its own file (chat JSONL, Alpaca JSON; a third whose
    line 2 is not JSON). The node with the bad file is left out with the reason in the server's log (a row number,
    no path); the run goes on with the other two, each training on its own file."""
    from common.data.members import write_members

    members = write_members(tmp_path / "members", examples_per_member=40)
    bad = tmp_path / "members" / "broken.jsonl"
    bad.write_text('{"prompt": "q", "completion": "a"}\n{"prompt": oops}\n')
    sources = f"{members[0][0]},{members[1][0]},{bad}"
    run_dir = tmp_path / "run"
    settings = f"num-server-rounds=1 min-train-replies=2 eval.generate-examples=2 data.partition-sources='{sources}'"
    proc = flwr_run(flwr_home, f"{FAST} {settings} run-dir='{run_dir}'")
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "Exit Code" not in log, log[-4000:]
    # the server's log gives the node's reason (a line number, no path: the node's own log has the path)
    assert "gave no initial adapter: client error: node data: line 2 is not valid JSON" in log, log[-4000:]
    rows = read_metrics(run_dir)
    first, last = per_client(rows, 0), per_client(rows, 1)
    assert sorted(first) == sorted(last) == [0, 1], first
    for partition, row in last.items():
        assert row["tasks"] == "node-data" and row["data_examples"] == 40, row
        assert row["eval_loss"] < first[partition]["eval_loss"], (partition, first[partition], row)


def test_fedavg_through_secagg_with_distributed_noise_counts_every_round_and_stops_at_its_target(flwr_home, tmp_path):
    """Member-level DP end to end: FedAvg through SecAgg+ on the real model with dp.target-epsilon=8 and a noise
    multiplier that the target carries through 2 rounds but not 3: rounds 1 and 2 run, each aggregate row says what
    was spent, the run stops before round 3 saying why; the global LoRA B (zero at the start) is as far from zero as
    the members' noise puts it (they add it before masking; the server only unmasks the sum)."""
    from common.privacy import epsilon_spent, noise_for_target

    run_dir, clip_norm = tmp_path / "dp", 0.01
    z = 1.02 * noise_for_target(8.0, 1e-5, 2)
    assert epsilon_spent(z, 3, 1e-5) > 8.0
    dp = f"dp.mode='distributed' dp.target-epsilon=8.0 dp.noise-multiplier={z!r} dp.clip-norm={clip_norm}"
    dp += " dp.record-partition-epsilons='8,6,7'"  # and record-level DP-SGD, each member its own target: both
    # what it checks needs training, not evaluation: no round 0, two held-out examples a round
    lean = "train.local-steps=4 eval.initial=false eval.max-examples=2 eval.generate-examples=1 eval.max-new-tokens=4"
    proc = flwr_run(flwr_home, f"{lean} num-server-rounds=3 secure=true min-train-replies=3 {dp} run-dir='{run_dir}'")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "round 3 would spend" in out and "epsilon" in out, out[-3000:]
    rows = read_metrics(run_dir)
    aggregate = {r["round"]: r for r in rows if r["node"] is None}
    assert sorted(aggregate) == [1, 2], "the run did not stop before round 3"
    spent = [aggregate[r]["dp_epsilon"] for r in (1, 2)]
    assert spent == pytest.approx([epsilon_spent(z, 1, 1e-5), epsilon_spent(z, 2, 1e-5)]) and spent[1] <= 8.0
    assert all(aggregate[r]["dp_mode"] == "distributed" and aggregate[r]["dp_noise_multiplier"] == z for r in (1, 2))
    trained = [r for r in rows if r["node"] is not None and r["round"] in (1, 2) and "accepted" in r]
    assert len(trained) == 6 and all(r["accepted"] and r["update_norm"] is None for r in trained), trained
    # nothing measured on a raw update left a node; each member's own ledger counted its releases, the server's too
    leaked = ("secagg_norm_clipped", "secagg_clipped", "robust")
    assert not [(r["node"], k) for r in trained for k in leaked if k in r], trained
    for r in trained:
        assert r["dp_member_releases"] == r["round"] and r["dp_member_releases_without_noise"] == 0, r
        assert r["dp_member_epsilon"] == pytest.approx(epsilon_spent(z, r["round"], 1e-5)), r
    ledger = [json.loads(line) for line in (run_dir / "privacy-ledger.jsonl").read_text().splitlines()]
    assert [(e["round"], e["noise_multiplier"]) for e in ledger] == [(1, z), (2, z)]
    # record-level: each member calibrated its own noise for the 3 planned rounds and has spent less than its target
    for r in trained:
        target = {0: 8.0, 1: 6.0, 2: 7.0}[r["partition_id"]]
        assert r["dp_record_target"] == target and 0 < r["dp_record_epsilon"] < target, r
        assert r["train_loss"] is None and r["train_tokens"] is None, r  # computed from its records: kept home
    b = np.concatenate([v.ravel() for k, v in global_adapter(run_dir).items() if "lora_B" in k])
    # two rounds of a mean over 3 members whose shares sum to N(0, (z C)^2) per coordinate: (z C / 3)^2 a round
    expected = np.sqrt(2) * z * clip_norm / 3 * np.sqrt(b.size)
    assert 0.9 * expected < np.linalg.norm(b) < 1.1 * expected + 2 * clip_norm, (np.linalg.norm(b), expected)


def test_record_level_dp_sgd_through_secagg_each_member_its_own_epsilon_and_one_stops_when_spent(flwr_home, tmp_path):
    """fedavg-dual (a personal LoRA beside the averaged one) through SecAgg+ with record-level DP-SGD on 4 members,
    each with its own target (simulation: dp.record-partition-epsilons) and z = 1.5 on 20 training records each
    (q = 0.1): every train row carries its member's epsilon, which is the accountant's for the steps it took; the
    member whose target (1.3) one round fits but two do not trains in round 1, then says its budget is spent and
    stops, while the run, SecAgg+ included, goes on with the other three and still evaluates it."""
    from common.record_privacy import Steps, record_epsilon

    run_dir = tmp_path / "dpsgd"
    lean = "train.local-steps=4 eval.initial=false eval.max-examples=2 eval.generate-examples=1 eval.max-new-tokens=4"
    dp = "dp.record-partition-epsilons='8,3,8,1.3' dp.record-noise-multiplier=1.5 data.max-train-examples=20"
    run = f"strategy='fedavg-dual' secure=true min-train-replies=3 num-server-rounds=2 run-dir='{run_dir}'"
    proc = flwr_run(flwr_home, f"{lean} {dp} {run}", num_clients=4)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    rows = read_metrics(run_dir)
    targets = {0: 8.0, 1: 3.0, 2: 8.0, 3: 1.3}
    for server_round in (1, 2):
        trained = {p: r for p, r in per_client(rows, server_round).items() if r.get("dp_record_epsilon") is not None}
        expected = record_epsilon([Steps(0.1, 1.5, 4 * server_round)], 1e-5)
        assert sorted(trained) == ([0, 1, 2, 3] if server_round == 1 else [0, 1, 2]), (server_round, trained)
        for p, r in trained.items():
            assert r["accepted"] and r["dp_record_target"] == targets[p], r
            assert r["dp_record_epsilon"] == pytest.approx(expected, rel=1e-6) and expected <= targets[p], r
            assert r["dp_record_noise_multiplier"] == 1.5 and r["dp_record_sampling_rate"] == 0.1, r
    stopped = per_client(rows, 2)[3]
    assert not stopped.get("accepted") and stopped["eval_loss"] is not None, stopped  # evaluated all the same
    assert "record-level budget spent" in out, out[-3000:]
    assert "record-level DP-SGD, partition 3: epsilon 1.217 of 1.3" in out, out[-3000:]
