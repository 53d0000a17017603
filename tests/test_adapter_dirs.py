"""One member cannot overwrite another family's exported adapter: the final adapters' directories are one per name
(``.smol`` and ``smol`` both wrote ``adapters/smol``, the last one winning), and a save that would write one
directory twice refuses the second, logged naming both, and saves the rest."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from server_app.rundir import RunDirectory
from strategies.base import FinalAdapter
from strategies.families import family_key


@pytest.fixture
def server_log(caplog):
    """The records of the server's logger (``tessera.server``, which does not propagate)."""
    logger = logging.getLogger("tessera.server")
    logger.addHandler(caplog.handler)
    try:
        yield caplog
    finally:
        logger.removeHandler(caplog.handler)


def test_families_that_differ_only_in_what_sanitising_drops_get_different_directories(tmp_path):
    run = RunDirectory(tmp_path / "run")
    models = (".smol", "smol", "..smol", "..", ".", "_", "a/b", "a_b", "Qwen/X", "Qwen_X", "q" * 300, "q" * 301)
    names = [family_key(m) for m in models]
    assert names[:2] == [".smol", "smol"]  # family keys keep the dot: two families
    dirs = [run.adapter_dir(n) for n in names]
    assert len(set(dirs)) == len(names), dirs
    adapters = (run.path / "adapters").resolve()
    assert all(d.parent == run.path / "adapters" and d.resolve().parent == adapters for d in dirs)
    assert all(len(d.name) <= 200 for d in dirs)  # a file system's 255 bytes, however long the model's name
    assert run.adapter_dir("smol") == run.path / "adapters" / "smol"  # a name that is already safe is kept
    assert run.adapter_dir(".smol").name.startswith("smol+") and not run.adapter_dir(".smol").name.startswith(".")
    assert run.adapter_dir(".smol") == run.adapter_dir(".smol")  # the same name, the same directory every run
    assert run.adapter_dir("atlas-c0") == run.path / "adapters" / "atlas-c0"


def test_a_directory_already_taken_in_a_save_is_refused_naming_both_and_the_rest_are_kept(
    tmp_path, monkeypatch, server_log
):
    run = RunDirectory(tmp_path / "run")
    assert run.adapter_dirs([".smol", "smol", "big"]) == {
        0: run.adapter_dir(".smol"),
        1: run.adapter_dir("smol"),
        2: run.adapter_dir("big"),
    }
    assert run.adapter_dirs(["smol", "big", "smol"]) == {0: run.adapter_dir("smol"), 1: run.adapter_dir("big")}
    real = RunDirectory.adapter_dir
    monkeypatch.setattr(RunDirectory, "adapter_dir", lambda self, name: real(self, name.lstrip(".")))  # the old bug
    assert run.adapter_dirs([".smol", "smol", "big"]) == {0: real(run, "smol"), 2: real(run, "big")}
    errors = [r.getMessage() for r in server_log.records if r.levelno == logging.ERROR]
    assert len(errors) == 2 and all("'smol'" in e for e in errors) and "'.smol'" in errors[1], errors


def test_saving_the_final_adapters_never_writes_one_directory_twice(tmp_path, monkeypatch, server_log):
    """``_save_adapters`` (the end of every run): ``.smol`` and ``smol`` are both saved, each in its own directory;
    with the directories forced to collide the first is kept as written, the second refused, the third saved."""
    import server_app.app as app

    def save_server_copy(arrays, cfg, base_model, out_dir: Path) -> Path:
        out_dir.mkdir(parents=True)  # exist_ok=False: a second write to one directory would raise here
        np.save(out_dir / "w.npy", arrays["w"])
        return out_dir

    monkeypatch.setattr(app, "adapter_kind", lambda name: SimpleNamespace(save_server_copy=save_server_copy))
    final = [FinalAdapter(name, name, {"w": np.full(2, float(i))}) for i, name in enumerate([".smol", "smol", "big"])]
    strategy = SimpleNamespace(final_adapters=lambda: final)
    run = RunDirectory(tmp_path / "run")
    saved = app._save_adapters(SimpleNamespace(adapter="lora"), strategy, run)
    assert len(set(saved)) == 3 and saved[1] == run.path / "adapters" / "smol"
    assert [float(np.load(d / "w.npy")[0]) for d in saved] == [0.0, 1.0, 2.0]

    real = RunDirectory.adapter_dir
    monkeypatch.setattr(RunDirectory, "adapter_dir", lambda self, name: real(self, name.lstrip(".")))
    other = RunDirectory(tmp_path / "other")
    saved = app._save_adapters(SimpleNamespace(adapter="lora"), strategy, other)
    assert saved == [other.path / "adapters" / "smol", other.path / "adapters" / "big"]
    assert float(np.load(saved[0] / "w.npy")[0]) == 0.0  # the first family's adapter, not overwritten by the second
    (error,) = [r.getMessage() for r in server_log.records if r.levelno == logging.ERROR]
    assert "'smol'" in error and "'.smol'" in error
