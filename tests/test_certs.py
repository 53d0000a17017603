"""``deploy/certs.py``: keys are never readable by others, ``--force`` never writes through a symlink, new ``--hosts``
re-issue the server certificate from the same CA, the certificates pass a real TLS handshake under
``ssl.VERIFY_X509_STRICT`` (Python 3.13's default, which refuses a certificate without key identifiers), and
``--renew`` re-issues the server certificate (and the CA, with its own key, only when due) keeping the node keys."""

from __future__ import annotations

import datetime as dt
import os
import socket
import ssl
import stat
import threading
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from deploy import certs

NODE_FILES = ("node-0.key", "node-0.pub", "node-1.key", "node-1.pub")


def strict_context(cafile: Path) -> ssl.SSLContext:
    """The client context Python 3.13 makes by default: ``create_default_context`` plus strict X.509 checks."""
    context = ssl.create_default_context(cafile=str(cafile))
    context.verify_flags |= ssl.VERIFY_X509_STRICT | ssl.VERIFY_X509_PARTIAL_CHAIN
    return context


def handshake(certs_dir: Path, server_name: str, client: ssl.SSLContext) -> bytes:
    """A real TLS connection: a server on 127.0.0.1 with ``server.pem``/``server.key``, ``client`` connecting to it
    as ``server_name``; returns what the server sent (the client raises if it refuses the certificate)."""
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(certs_dir / "server.pem", certs_dir / "server.key")
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(10)

        def serve() -> None:
            try:
                conn, _ = listener.accept()
                with server.wrap_socket(conn, server_side=True) as tls:
                    tls.sendall(b"hello")
            except OSError:  # the client refused the certificate: it raises on its side
                pass

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        with socket.create_connection(listener.getsockname(), timeout=10) as raw:
            with client.wrap_socket(raw, server_hostname=server_name) as tls:
                received = tls.recv(16)
        thread.join(10)
    return received


def load(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


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


@pytest.mark.parametrize("strict", [False, True], ids=["default", "strict"])
@pytest.mark.parametrize("name", ["127.0.0.1", "localhost"])
def test_a_client_completes_a_real_handshake_under_strict_x509_checks(tmp_path, name, strict):
    certs.generate(tmp_path, ["127.0.0.1", "localhost"], nodes=0)
    cafile = tmp_path / "ca.crt"
    client = strict_context(cafile) if strict else ssl.create_default_context(cafile=str(cafile))
    assert handshake(tmp_path, name, client) == b"hello"


def test_a_name_not_in_the_certificate_is_still_refused(tmp_path):
    certs.generate(tmp_path, ["127.0.0.1"], nodes=0)
    with pytest.raises(ssl.SSLCertVerificationError):
        handshake(tmp_path, "localhost", strict_context(tmp_path / "ca.crt"))


def test_ca_and_server_certificates_carry_the_extensions_tls_expects(tmp_path):
    certs.generate(tmp_path, ["127.0.0.1", "superlink.example.org"], nodes=0)
    ca, server = load(tmp_path / "ca.crt"), load(tmp_path / "server.pem")
    ext = ca.extensions
    basic = ext.get_extension_for_class(x509.BasicConstraints)
    assert basic.critical and basic.value.ca and basic.value.path_length == 0
    usage = ext.get_extension_for_class(x509.KeyUsage)
    assert usage.critical and usage.value.key_cert_sign and usage.value.crl_sign and not usage.value.digital_signature
    ca_ski = ext.get_extension_for_class(x509.SubjectKeyIdentifier).value
    assert ca_ski == x509.SubjectKeyIdentifier.from_public_key(ca.public_key())
    assert (ca.not_valid_after_utc - ca.not_valid_before_utc).days == certs.CA_DAYS

    ext = server.extensions
    basic = ext.get_extension_for_class(x509.BasicConstraints)
    assert basic.critical and not basic.value.ca
    assert isinstance(server.public_key(), ec.EllipticCurvePublicKey)  # so no keyEncipherment (RSA key transport)
    usage = ext.get_extension_for_class(x509.KeyUsage)
    assert usage.critical and usage.value.digital_signature
    assert not (usage.value.key_encipherment or usage.value.key_cert_sign or usage.value.crl_sign)
    assert list(ext.get_extension_for_class(x509.ExtendedKeyUsage).value) == [ExtendedKeyUsageOID.SERVER_AUTH]
    assert ext.get_extension_for_class(x509.SubjectKeyIdentifier).value == x509.SubjectKeyIdentifier.from_public_key(
        server.public_key()
    )
    assert ext.get_extension_for_class(x509.AuthorityKeyIdentifier).value.key_identifier == ca_ski.digest
    assert certs._server_names(tmp_path / "server.pem") == {"127.0.0.1", "superlink.example.org"}
    assert (server.not_valid_after_utc - server.not_valid_before_utc).days == certs.SERVER_DAYS


def test_renew_reissues_the_server_certificate_and_keeps_node_keys_and_ca(tmp_path, monkeypatch):
    monkeypatch.setattr(certs, "SERVER_DAYS", 30)  # a certificate close to expiry
    certs.generate(tmp_path, ["127.0.0.1", "localhost"], nodes=2)
    monkeypatch.undo()
    kept = {name: (tmp_path / name).read_bytes() for name in ("ca.crt", "ca.key", *NODE_FILES)}
    old = load(tmp_path / "server.pem")

    certs.generate(tmp_path, ["127.0.0.1", "localhost"], nodes=2, renew=True)
    assert {name: (tmp_path / name).read_bytes() for name in kept} == kept  # the CA has ten years left
    new = load(tmp_path / "server.pem")
    assert new.not_valid_after_utc > old.not_valid_after_utc and new.serial_number != old.serial_number
    assert stat.S_IMODE((tmp_path / "server.key").stat().st_mode) == 0o600
    for name in ("127.0.0.1", "localhost"):
        assert handshake(tmp_path, name, strict_context(tmp_path / "ca.crt")) == b"hello"


@pytest.mark.parametrize("why", ["close to expiry", "asked"])
def test_renew_reissues_the_ca_with_its_own_key_when_due_or_asked(tmp_path, monkeypatch, why):
    if why == "close to expiry":
        monkeypatch.setattr(certs, "CA_DAYS", certs.SERVER_DAYS - 1)  # would expire before a new server cert
    certs.generate(tmp_path, ["127.0.0.1"], nodes=2)
    monkeypatch.undo()
    kept = {name: (tmp_path / name).read_bytes() for name in ("ca.key", *NODE_FILES)}
    (tmp_path / "old-ca.crt").write_bytes((tmp_path / "ca.crt").read_bytes())
    old = load(tmp_path / "ca.crt")

    certs.generate(tmp_path, ["127.0.0.1"], nodes=2, renew=True, renew_ca=why == "asked")
    assert {name: (tmp_path / name).read_bytes() for name in kept} == kept
    new = load(tmp_path / "ca.crt")
    assert new.serial_number != old.serial_number and new.subject == old.subject
    assert new.not_valid_after_utc >= old.not_valid_after_utc
    ski = x509.SubjectKeyIdentifier
    assert new.extensions.get_extension_for_class(ski) == old.extensions.get_extension_for_class(ski)
    # nodes still holding the old ca.crt keep connecting until it expires, and the new one works too
    for cafile in ("old-ca.crt", "ca.crt"):
        assert handshake(tmp_path, "127.0.0.1", strict_context(tmp_path / cafile)) == b"hello"


def test_renew_upgrades_a_ca_made_without_key_identifiers(tmp_path):
    """A CA from the earlier deploy/certs.py (BasicConstraints only), which Python 3.13 refuses: ``--renew``
    re-issues it with the same key: node keys are untouched, and the old ca.crt still verifies the new server
    certificate where verification is not strict (before Python 3.13)."""
    key = ec.generate_private_key(ec.SECP384R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "Tessera federation CA")])
    now = dt.datetime.now(dt.timezone.utc)
    old = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=certs.CA_DAYS))  # not due for expiry
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(key, hashes.SHA384())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    (tmp_path / "ca.key").write_bytes(key_pem)
    (tmp_path / "ca.crt").write_bytes(old.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "old-ca.crt").write_bytes(old.public_bytes(serialization.Encoding.PEM))
    certs.generate(tmp_path, ["127.0.0.1"], nodes=1)  # a plain re-run changes no existing file
    assert (tmp_path / "ca.crt").read_bytes() == (tmp_path / "old-ca.crt").read_bytes()
    with pytest.raises(ssl.SSLCertVerificationError):
        handshake(tmp_path, "127.0.0.1", strict_context(tmp_path / "ca.crt"))

    node = (tmp_path / "node-0.key").read_bytes()
    certs.generate(tmp_path, ["127.0.0.1"], nodes=1, renew=True)
    assert (tmp_path / "ca.key").read_bytes() == key_pem and (tmp_path / "node-0.key").read_bytes() == node
    assert load(tmp_path / "ca.crt").extensions.get_extension_for_class(x509.KeyUsage).value.key_cert_sign
    assert handshake(tmp_path, "127.0.0.1", strict_context(tmp_path / "ca.crt")) == b"hello"
    assert handshake(tmp_path, "127.0.0.1", ssl.create_default_context(cafile=str(tmp_path / "old-ca.crt")))


def test_cli_renew_without_hosts_keeps_the_certificate_names(tmp_path, capsys):
    certs.main(["--out", str(tmp_path), "--hosts", "superlink.example.org,10.0.0.1", "--nodes", "1"])
    node = (tmp_path / "node-0.key").read_bytes()
    first = (tmp_path / "server.pem").read_bytes()
    certs.main(["--out", str(tmp_path), "--nodes", "1", "--renew"])
    assert (tmp_path / "server.pem").read_bytes() != first and (tmp_path / "node-0.key").read_bytes() == node
    assert certs._server_name_list(tmp_path / "server.pem") == ["superlink.example.org", "10.0.0.1"]
    assert "server certificate re-issued" in capsys.readouterr().out
