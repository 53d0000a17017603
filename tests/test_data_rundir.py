"""The run directory: checkpoints, metrics, adapters (the data has tests/test_data_bank.py and test_own_data.py)."""

import numpy as np
import pytest

from server_app.rundir import RunDirectory


def test_checkpoint_round_trip_and_metric_truncation(tmp_path):
    run = RunDirectory(tmp_path / "run")
    state = {"global": {"a.weight": np.arange(6, dtype=np.float32).reshape(2, 3)}}
    run.save_checkpoint(2, "fedavg", state, {"nodes": [1, 2]})
    meta, loaded = run.load_checkpoint()
    assert meta["round"] == 2 and meta["strategy"] == "fedavg"
    np.testing.assert_array_equal(loaded["global"]["a.weight"], state["global"]["a.weight"])
    run.append_metrics([{"round": r, "node": n, "eval_loss": 3.0 - r} for r in range(4) for n in (1, None)])
    run.truncate_metrics_after(2)
    assert max(r["round"] for r in run.read_metrics()) == 2
    assert run.plot_eval_loss().stat().st_size > 1000


def test_a_crash_while_checkpointing_leaves_the_previous_round_whole(tmp_path, monkeypatch):
    import os

    run = RunDirectory(tmp_path / "run")
    run.save_checkpoint(1, "fedavg", {"global": {"w": np.ones(3, np.float32)}}, {})
    real_replace, calls = os.replace, []

    def crash_before_the_json(src, dst):  # the process dies after the arrays, before the json naming them
        calls.append(dst)
        if str(dst).endswith("state.json"):
            raise OSError("killed")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", crash_before_the_json)
    with pytest.raises(OSError):
        run.save_checkpoint(2, "fedavg", {"global": {"w": np.full(3, 2.0, np.float32)}}, {})
    monkeypatch.setattr(os, "replace", real_replace)
    assert calls[0].name == "state-00002.npz"  # round 2's arrays did land, under their own name
    meta, state = run.load_checkpoint()
    assert meta["round"] == 1
    np.testing.assert_array_equal(state["global"]["w"], np.ones(3, np.float32))  # round 1's arrays, not round 2's


def test_resume_without_a_checkpoint_is_refused_and_keeps_the_metrics(tmp_path):
    """It used to start over silently and delete metrics.jsonl, the very thing a resume means to continue."""
    from flwr.app import Context, RecordDict

    from server_app.app import run_federation

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"round": 0, "node": null}\n')
    context = Context(1, 0, {}, RecordDict(), {"resume": True, "run-dir": str(run_dir)})
    with pytest.raises(ValueError, match="resume=true: no checkpoint"):
        run_federation(None, context)  # refused before it asks the grid for anything
    assert (run_dir / "metrics.jsonl").read_text() == '{"round": 0, "node": null}\n'


def _two_rounds(tmp_path) -> RunDirectory:
    run = RunDirectory(tmp_path / "run")
    for server_round in (1, 2):
        run.save_checkpoint(server_round, "fedavg", {"global": {"w": np.full(3, float(server_round), np.float32)}}, {})
    return run


@pytest.mark.parametrize("damage", ["torn json", "truncated arrays", "arrays outside the run"])
def test_a_damaged_last_checkpoint_falls_back_to_the_previous_round(tmp_path, damage):
    run = _two_rounds(tmp_path)
    last = run.checkpoint_dir / "state.json"
    if damage == "torn json":
        last.write_text(last.read_text()[:20])
    elif damage == "truncated arrays":
        npz = run.checkpoint_dir / "state-00002.npz"
        npz.write_bytes(npz.read_bytes()[:50])
    else:  # a state.json edited to point elsewhere is not followed
        (tmp_path / "elsewhere.npz").write_bytes((run.checkpoint_dir / "state-00002.npz").read_bytes())
        last.write_text(last.read_text().replace('"state-00002.npz"', '"../../elsewhere.npz"'))
    meta, state = run.load_checkpoint()
    assert meta["round"] == 1 and np.all(state["global"]["w"] == 1.0)


def test_a_checkpoint_with_nothing_readable_is_an_error_not_a_fresh_start(tmp_path):
    run = _two_rounds(tmp_path)
    for name in ("state.json", "state.prev.json"):
        (run.checkpoint_dir / name).write_text("{")
    with pytest.raises(ValueError, match="no readable checkpoint"):
        run.load_checkpoint()


def test_only_the_last_two_rounds_are_kept_on_disk(tmp_path):
    run = _two_rounds(tmp_path)
    run.save_checkpoint(3, "fedavg", {"global": {"w": np.zeros(3, np.float32)}}, {})
    assert sorted(p.name for p in run.checkpoint_dir.iterdir()) == [
        "state-00002.npz",
        "state-00003.npz",
        "state.json",
        "state.prev.json",
    ]


def test_a_torn_last_metrics_line_is_ignored_but_a_torn_middle_line_is_an_error(tmp_path):
    run = RunDirectory(tmp_path / "run")
    run.append_metrics([{"round": 0, "node": None}, {"round": 1, "node": None}])
    with open(run.metrics_path, "a") as handle:
        handle.write('{"round": 2, "no')  # the process died while appending
    assert [r["round"] for r in run.read_metrics()] == [0, 1]
    run.metrics_path.write_text('{"round": 0}\n{"rou\n{"round": 1}\n')
    with pytest.raises(ValueError, match="line 2"):
        run.read_metrics()


@pytest.mark.parametrize("name", ["..", "../../etc", "/abs/path", "a/../../b", ".hidden", "qwen/7b"])
def test_adapter_directories_from_model_names_stay_inside_the_run(tmp_path, name):
    run = RunDirectory(tmp_path / "run")
    target = run.adapter_dir(name).resolve()
    assert target.is_relative_to((run.path / "adapters").resolve()) and target != (run.path / "adapters").resolve()
    assert run.adapter_dir("") == run.path / "adapter"


# A read-only or full run dir must be found before the first message to any node, not after round 0's evaluation.
def _write_refused(run_dir, monkeypatch, refuse_errno: int) -> None:
    """Make writes under ``run_dir`` fail with ``refuse_errno``: for real (chmod) when that stops this user, else
    (root, which chmod does not stop) at the system call, so that the code above it runs as it would."""
    import errno
    import os

    if refuse_errno == errno.EACCES:
        run_dir.chmod(0o555)
        try:
            (run_dir / "probe-by-test").touch()
        except PermissionError:
            return  # chmod stops this user: the real mechanism
        (run_dir / "probe-by-test").unlink()
        run_dir.chmod(0o755)
    real_open, real_mkdir = os.open, os.mkdir
    under = str(run_dir)

    def refusing_open(path, flags, *args, **kwargs):
        if str(path).startswith(under) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise OSError(refuse_errno, os.strerror(refuse_errno), str(path))
        return real_open(path, flags, *args, **kwargs)

    def refusing_mkdir(path, *args, **kwargs):
        if str(path).startswith(under) and not os.path.isdir(path):
            raise OSError(refuse_errno, os.strerror(refuse_errno), str(path))
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", refusing_open)
    monkeypatch.setattr(os, "mkdir", refusing_mkdir)


@pytest.mark.parametrize("which", ["run dir", "checkpoint dir"])
def test_a_read_only_run_dir_is_refused_before_the_first_round(tmp_path, monkeypatch, which):
    import errno

    from server_app.rundir import RunDirNotWritableError

    run = RunDirectory(tmp_path / "run")
    run.check_writable()  # writable: passes, and leaves nothing behind but the checkpoint directory
    assert sorted(p.name for p in run.path.rglob("*")) == ["checkpoint"]
    directory = run.path if which == "run dir" else run.checkpoint_dir
    _write_refused(directory, monkeypatch, errno.EACCES)
    try:
        with pytest.raises(RunDirNotWritableError, match="not writable") as raised:
            run.check_writable()
    finally:
        directory.chmod(0o755)
    message = str(raised.value)
    assert str(directory) in message and "choose another run-dir" in message
    assert isinstance(raised.value, OSError) and raised.value.errno == errno.EACCES
    assert sorted(p.name for p in run.path.rglob("*")) == ["checkpoint"]


def test_a_run_dir_that_cannot_be_created_names_it(tmp_path, monkeypatch):
    import errno

    from server_app.rundir import RunDirNotWritableError

    _write_refused(tmp_path, monkeypatch, errno.EACCES)
    try:
        with pytest.raises(RunDirNotWritableError, match="choose another run-dir") as raised:
            RunDirectory(tmp_path / "run")
    finally:
        tmp_path.chmod(0o755)
    assert str(tmp_path / "run") in str(raised.value)


@pytest.mark.parametrize("where", ["write", "fsync"])
def test_a_full_disk_is_found_before_the_first_round(tmp_path, monkeypatch, where):
    import errno
    import os

    from server_app.rundir import RunDirNotWritableError

    run = RunDirectory(tmp_path / "run")
    real = getattr(os, where)

    def disk_full(fd, *args):
        if os.path.realpath(f"/proc/self/fd/{fd}").startswith(str(run.path)):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, *args)

    monkeypatch.setattr(os, where, disk_full)
    with pytest.raises(RunDirNotWritableError, match="free space") as raised:
        run.check_writable()
    assert str(run.path) in str(raised.value) and raised.value.errno == errno.ENOSPC
    assert list(run.path.iterdir()) == []  # the probe is removed


def test_metrics_that_cannot_be_appended_to_are_found_before_the_first_round(tmp_path, monkeypatch):
    import errno
    import os

    from server_app.rundir import RunDirNotWritableError

    run = RunDirectory(tmp_path / "run")
    run.append_metrics([{"round": 0, "node": None}])
    real_open = os.open

    def read_only_file(path, flags, *args, **kwargs):
        if str(path) == str(run.metrics_path) and flags & (os.O_WRONLY | os.O_RDWR):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", read_only_file)
    with pytest.raises(RunDirNotWritableError, match="metrics.jsonl"):
        run.check_writable()


# A full disk while checkpointing keeps the previous checkpoint and leaves no partial file behind.
def _three_rounds(tmp_path) -> RunDirectory:
    run = RunDirectory(tmp_path / "run")
    for server_round in (1, 2):
        run.save_checkpoint(server_round, "fedavg", {"global": {"w": np.full(3, float(server_round), np.float32)}}, {})
    return run


def _on_disk(run: RunDirectory) -> list[str]:
    return sorted(p.name for p in run.checkpoint_dir.iterdir())


def _checkpoint_steps(run: RunDirectory, fail_at: int | None = None) -> int:
    """Save round 3 counting its fsync/replace steps; with ``fail_at``, that step fails: the disk is full."""
    import errno
    import os

    real_fsync, real_replace, count = os.fsync, os.replace, [0]

    def step(real):
        def counted(*args):
            count[0] += 1
            if count[0] - 1 == fail_at:
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(*args)

        return counted

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "fsync", step(real_fsync))
        patch.setattr(os, "replace", step(real_replace))
        run.save_checkpoint(3, "fedavg", {"global": {"w": np.zeros(3, np.float32)}}, {})
    return count[0]


def _partial_savez(handle, **arrays):
    import errno

    handle.write(b"PK\x03\x04 half an archive")
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_at_any_step_of_a_checkpoint_keeps_the_previous_round(tmp_path, monkeypatch):
    """The disk fills up while the arrays are written, or at any later fsync or rename: the save fails with a
    CheckpointError naming the round and directory, no partial file is left, the checkpoint is round 2 as it was (or
    round 3 whole, where the failure came after it landed), and the next save works once there is space again."""
    from server_app.rundir import CheckpointError

    steps = _checkpoint_steps(_three_rounds(tmp_path / "count"))
    assert steps >= 5  # the arrays and the json each fsynced and renamed, the directory fsynced
    outcomes = []
    for fail_at in ["savez", *range(steps)]:
        run = _three_rounds(tmp_path / str(fail_at))
        before = _on_disk(run)
        with pytest.raises(CheckpointError, match="round 3") as raised:
            if fail_at == "savez":
                with monkeypatch.context() as patch:
                    patch.setattr(np, "savez", _partial_savez)
                    _checkpoint_steps(run)
            else:
                _checkpoint_steps(run, fail_at)
        assert str(run.checkpoint_dir) in str(raised.value) and "free space" in str(raised.value), fail_at
        assert isinstance(raised.value, OSError), fail_at
        assert not [name for name in _on_disk(run) if "tmp" in name], fail_at  # no partial file left
        meta, state = run.load_checkpoint()
        assert meta["round"] in (2, 3), fail_at  # the previous round or the new one, never nothing
        w = np.full(3, 2.0 if meta["round"] == 2 else 0.0, np.float32)
        np.testing.assert_array_equal(state["global"]["w"], w, err_msg=str(fail_at))
        outcomes.append(meta["round"])
        next_round = meta["round"] + 1  # what a resumed run checkpoints next
        if meta["round"] == 2:  # nothing changed: round 2 and the round before it (state.prev.json) as they were
            assert _on_disk(run) == before, fail_at
            (run.checkpoint_dir / "state.json").write_text("{")
            meta, state = run.load_checkpoint()
            assert meta["round"] == 1 and np.all(state["global"]["w"] == 1.0), fail_at
            fallback = "state-00001.npz"  # and a torn state.json never replaces the whole round before it
        else:  # the new round landed (the failure was after it): the round before it is the fallback
            assert _on_disk(run) == ["state-00002.npz", "state-00003.npz", "state.json", "state.prev.json"], fail_at
            fallback = "state-00003.npz"
        run.save_checkpoint(next_round, "fedavg", {"global": {"w": np.zeros(3, np.float32)}}, {})  # space again
        assert _on_disk(run) == [fallback, f"state-{next_round:05d}.npz", "state.json", "state.prev.json"], fail_at
        assert run.load_checkpoint()[0]["round"] == next_round, fail_at
    assert outcomes.count(2) >= steps  # only a failure after state.json was renamed (its fsync) keeps round 3


def test_a_full_disk_while_writing_metrics_leaves_no_torn_line_and_names_the_fix(tmp_path, monkeypatch):
    """The disk fills up in the middle of a round's rows: metrics.jsonl is cut back to the rows before them (a torn
    line would break every reader), and the error names the file and what to do; a resume's truncation that fails
    keeps the file as it was."""
    import builtins
    import errno

    import server_app.rundir as rundir
    from server_app.rundir import MetricsError

    run = RunDirectory(tmp_path / "run")
    run.append_metrics([{"round": 1, "node": 1, "eval_loss": 1.0}])
    before = run.metrics_path.read_bytes()

    class HalfWrite:
        def __init__(self, handle):
            self.handle = handle

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.handle.close()

        def write(self, text):
            self.handle.write(text[: len(text) // 2])
            self.handle.flush()
            raise OSError(errno.ENOSPC, "No space left on device")

    def full_disk_open(path, mode="r", *args, **kwargs):
        handle = builtins.open(path, mode, *args, **kwargs)
        return HalfWrite(handle) if mode == "a" else handle

    monkeypatch.setattr(rundir, "open", full_disk_open, raising=False)
    with pytest.raises(MetricsError, match="free space") as raised:
        run.append_metrics([{"round": 2, "node": n, "eval_loss": 2.0, "pad": "x" * 500} for n in range(4)])
    assert str(run.metrics_path) in str(raised.value) and raised.value.errno == errno.ENOSPC
    assert run.metrics_path.read_bytes() == before  # no torn line
    monkeypatch.undo()
    run.append_metrics([{"round": 2, "node": 1, "eval_loss": 2.0}])  # space again: it goes on
    assert [r["round"] for r in run.read_metrics()] == [1, 2]

    def no_replace(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(rundir.os, "replace", no_replace)
    with pytest.raises(MetricsError, match="rows after round 1 not dropped"):
        run.truncate_metrics_after(1)
    assert [r["round"] for r in run.read_metrics()] == [1, 2] and not run.metrics_path.with_suffix(".tmp").exists()
