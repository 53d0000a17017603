"""``deploy/certs.py``: keys are never readable by others, ``--force`` never writes through a symlink, and new
``--hosts`` re-issue the server certificate from the same CA."""

from __future__ import annotations

import os
import stat

from deploy import certs


def test_keys_are_created_0600_with_no_window_where_others_can_read_them(tmp_path, monkeypatch):
    modes = {}
    real_replace = os.replace

    def note_mode(src, dst):  # the file as it is before it takes its name
        modes[os.path.basename(dst)] = stat.S_IMODE(os.stat(src).st_mode)
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", note_mode)
    certs.generate(tmp_path, ["127.0.0.1"], nodes=2)
    for key in ("ca.key", "server.key", "node-0.key", "node-1.key"):
        assert modes[key] == 0o600, key
        assert stat.S_IMODE((tmp_path / key).stat().st_mode) == 0o600, key


def test_force_replaces_a_symlink_instead_of_writing_through_it(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("do not touch")
    out = tmp_path / "certs"
    certs.generate(out, ["127.0.0.1"], nodes=1)
    (out / "ca.key").unlink()
    (out / "ca.key").symlink_to(victim)
    certs.generate(out, ["127.0.0.1"], nodes=1, force=True)
    assert victim.read_text() == "do not touch"
    assert not (out / "ca.key").is_symlink() and b"PRIVATE KEY" in (out / "ca.key").read_bytes()


def test_new_hosts_reissue_the_server_certificate_from_the_same_ca(tmp_path):
    certs.generate(tmp_path, ["127.0.0.1", "localhost"], nodes=1)
    ca, node = (tmp_path / "ca.crt").read_bytes(), (tmp_path / "node-0.key").read_bytes()
    certs.generate(tmp_path, ["127.0.0.1", "localhost"], nodes=1)  # same hosts: nothing changes
    first = (tmp_path / "server.pem").read_bytes()
    assert certs._server_names(tmp_path / "server.pem") == {"127.0.0.1", "localhost"}
    certs.generate(tmp_path, ["10.0.0.1", "superlink.example.org"], nodes=1)
    assert certs._server_names(tmp_path / "server.pem") == {"10.0.0.1", "superlink.example.org"}
    assert (tmp_path / "server.pem").read_bytes() != first
    assert (tmp_path / "ca.crt").read_bytes() == ca and (tmp_path / "node-0.key").read_bytes() == node
