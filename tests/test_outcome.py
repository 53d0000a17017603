"""A failed run fails its command (``deploy.outcome``): the run's id is read from what `flwr run` printed, and a log
that names no run is an error of its own. The SuperLink's verdict itself is exercised end to end
(``tests/test_e2e_simulation.py``: a refused run config exits 1)."""

from __future__ import annotations

import subprocess

from deploy.outcome import checked, main, run_id_in


def test_the_run_id_is_read_from_the_stream_or_the_json_flwr_run_prints():
    assert run_id_in("INFO :      Starting logstream for run_id `1665929617201321542`\n") == 1665929617201321542
    assert run_id_in('{\n  "success": true,\n  "run-id": "42"\n}') == 42
    assert run_id_in("❌ Failed to connect to the SuperLink") is None


def test_a_log_that_names_no_run_exits_2_and_a_failed_flwr_run_keeps_its_code(tmp_path, capsys):
    log = tmp_path / "run.log"
    log.write_text("could not start\n")
    assert main(["local", str(log)]) == 2
    assert "no run was started" in capsys.readouterr().err
    failed = subprocess.CompletedProcess(["flwr"], 3, "", "boom")
    assert checked(failed, "local") is failed  # flwr run's own failure stands as it is


def test_help_exits_0_and_says_how_to_use_it(capsys):
    assert main(["--help"]) == 0
    assert "python -m deploy.outcome local run.log" in capsys.readouterr().err
