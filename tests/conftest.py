"""Shared fixtures. Unit tests use tiny random models; tests marked ``e2e`` use the real 4-bit SmolLM2."""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def pytest_collection_modifyitems(config, items):
    """An e2e test outside ``test_e2e_*.py`` is a whole federation on a tiny model in a child process with its own
    Ray (``tests/child.py``): marked ``inprocess``, so that ``scripts/test.sh`` runs it on every core beside the unit
    tests; the real-model runs (``test_e2e_*.py``) start SuperLinks, SuperNodes and Ray and run after them, in two
    lanes of one file at a time (``scripts/test.sh``)."""
    for item in items:
        if item.get_closest_marker("e2e") and not item.path.name.startswith("test_e2e_"):
            item.add_marker(pytest.mark.inprocess)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A failure's report says what the machine looked like: free memory and the biggest processes (a run that fails
    only on another machine is then diagnosable from its log)."""
    report = yield
    if report.failed:
        report.sections.append(("machine at failure", _machine_snapshot()))
    return report


def _machine_snapshot() -> str:
    import psutil

    mem = psutil.virtual_memory()
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    lines = [f"memory: {mem.available / 2**30:.1f} GiB available of {mem.total / 2**30:.1f} GiB; load {load}"]
    procs = sorted(psutil.process_iter(["pid", "memory_info", "cmdline"]), key=_rss, reverse=True)
    for proc in procs[:10]:
        cmd = " ".join(proc.info["cmdline"] or [])[:150]
        lines.append(f"{proc.info['pid']:>7} {_rss(proc) / 2**20:8.0f} MiB  {cmd}")
    return "\n".join(lines)


def _rss(proc) -> int:
    info = proc.info.get("memory_info")
    return info.rss if info else 0


@pytest.fixture(scope="module", autouse=True)
def no_processes_outlive_their_module():
    """Processes a test module started (Ray, model workers, SuperNodes) end with it: one that survives a failure
    would hold memory and cores and fail the modules after it for a reason that is not theirs."""
    import psutil

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    yield
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    _, alive = psutil.wait_procs(left, timeout=10)  # the normal case: they are on their way out
    for proc in alive:
        try:
            command = " ".join(proc.cmdline())[:200]
            proc.kill()
        except psutil.NoSuchProcess:
            continue
        warnings.warn(f"killed process {proc.pid}, left running by the module: {command}", stacklevel=1)
    psutil.wait_procs(alive, timeout=10)


@pytest.fixture
def task_identity():
    """Flower's Message needs the run/node/task identity a real ServerApp or ClientApp process has."""
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    yield


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A tiny random-weight Llama checkpoint with a real tokenizer (SmolLM2's), saved like any HF model."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from common.assets import smollm2_checkpoint

    tokenizer = AutoTokenizer.from_pretrained(smollm2_checkpoint())
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    out = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
