"""Certificates and keys for a TLS-authenticated Flower deployment, made with `cryptography` (no openssl).

    python -m deploy.certs --out deploy/certs --hosts 127.0.0.1,localhost,superlink.example.org --nodes 3

writes
- ``ca.crt`` / ``ca.key`` — a self-signed CA valid for ``CA_DAYS`` (3650 days; keep ``ca.key`` offline in a real
  deployment);
- ``server.pem`` / ``server.key`` — the SuperLink's TLS certificate, valid for ``SERVER_DAYS`` (825 days) and for
  every name in ``--hosts``;
- ``node-<i>.key`` / ``node-<i>.pub`` — per-SuperNode EC P-384 key pairs in OpenSSH format, the format
  ``flower-supernode --auth-supernode-private-key`` and ``flwr supernode register`` read.
Existing files are kept unless ``--force`` is given, so re-running never invalidates registered nodes.

Both certificates carry the extensions strict X.509 verification (Python 3.13's default context,
``ssl.VERIFY_X509_STRICT``) requires: the CA BasicConstraints(ca=True, path_length=0) and KeyUsage
keyCertSign+cRLSign (both critical) and its key identifier (also as authority key identifier); the server
certificate BasicConstraints(ca=False) and KeyUsage digitalSignature (both critical; an EC key, so no
keyEncipherment), ExtendedKeyUsage serverAuth (it is never a client certificate: SuperNodes authenticate with their
node keys), its key identifier, the CA's as authority key identifier, and the names in ``--hosts`` as
SubjectAltName.

``--renew`` re-issues the server certificate (a new key, the names in ``--hosts`` or, without it, the current
certificate's) and never touches ``node-*.key``/``node-*.pub``. The CA is re-issued as well only when it expires
within ``SERVER_DAYS`` (a new server certificate would outlive it), when it lacks the extensions above (made by an
earlier version of this script), or with ``--renew-ca``; it keeps its key and name, so the ``ca.crt`` the nodes
hold still verifies the new server certificate until it expires (one made by an earlier version only where
verification is not strict, i.e. before Python 3.13): copy the new ``ca.crt`` to them before then.
"""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_DAYS = 3650  # the CA (its renewal means copying ca.crt to every node)
SERVER_DAYS = 825  # the SuperLink's certificate (renewed on the SuperLink's host alone, with --renew)
CA_NAME = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "Tessera federation CA")])
DEFAULT_HOSTS = "127.0.0.1,localhost"


def _write(path: Path, data: bytes, private: bool = False) -> None:
    """Write ``data`` to a fresh file created with its final mode (0600 for keys: never readable by others, not
    even briefly), then renamed over ``path``: an existing file or symlink there is replaced, never followed."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
    os.replace(tmp, path)


def _server_name_list(cert_path: Path) -> list[str]:
    """The SubjectAltNames of a certificate, in order (the first is also its common name)."""
    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return [str(n.value) for n in names]


def _server_names(cert_path: Path) -> set[str]:
    return set(_server_name_list(cert_path))


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _key_usage(digital_signature: bool = False, key_cert_sign: bool = False, crl_sign: bool = False) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=digital_signature,
        content_commitment=False,
        key_encipherment=False,  # RSA key transport only; every key here is EC (ECDHE + ECDSA)
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=key_cert_sign,
        crl_sign=crl_sign,
        encipher_only=False,
        decipher_only=False,
    )


def _builder(
    subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey, days: int
) -> x509.CertificateBuilder:
    now = dt.datetime.now(dt.timezone.utc)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
    )


def make_ca(
    out: Path, days: int | None = None, key: ec.EllipticCurvePrivateKey | None = None, name: x509.Name = CA_NAME
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A self-signed CA valid for ``days`` (default ``CA_DAYS``). With ``key`` (a renewal) ``ca.key`` is left as it
    is and the certificate keeps that key and ``name``: what the CA signed, and its previous ``ca.crt``, stay valid."""
    fresh = key is None
    if key is None:
        key = ec.generate_private_key(ec.SECP384R1())
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (
        _builder(name, name, key.public_key(), CA_DAYS if days is None else days)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(key_cert_sign=True, crl_sign=True), critical=True)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski), critical=False)
        .sign(key, hashes.SHA384())
    )
    if fresh:
        _write(out / "ca.key", _key_pem(key), private=True)
    _write(out / "ca.crt", cert.public_bytes(serialization.Encoding.PEM))
    return key, cert


def _authority_key_identifier(
    ca_key: ec.EllipticCurvePrivateKey, ca_cert: x509.Certificate
) -> x509.AuthorityKeyIdentifier:
    try:
        ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    except x509.ExtensionNotFound:  # a CA from an earlier version: the same (RFC 5280 method 1) key identifier
        return x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key())
    return x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski)


def make_server_cert(
    out: Path, ca_key: ec.EllipticCurvePrivateKey, ca_cert: x509.Certificate, hosts: list[str], days: int | None = None
) -> None:
    """A new key and a certificate signed by the CA for every name in ``hosts``, valid for ``days`` (default
    ``SERVER_DAYS``), for TLS servers only (the SuperLink and the fleet gate)."""
    key = ec.generate_private_key(ec.SECP384R1())
    alt_names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            alt_names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            alt_names.append(x509.DNSName(host))
    cert = (
        _builder(
            x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]),
            ca_cert.subject,
            key.public_key(),
            SERVER_DAYS if days is None else days,
        )
        .add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(digital_signature=True), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(_authority_key_identifier(ca_key, ca_cert), critical=False)
        .sign(ca_key, hashes.SHA384())
    )
    _write(out / "server.key", _key_pem(key), private=True)
    _write(out / "server.pem", cert.public_bytes(serialization.Encoding.PEM))


def make_node_keys(out: Path, index: int) -> None:
    key = ec.generate_private_key(ec.SECP384R1())
    private = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
    )
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    _write(out / f"node-{index}.key", private, private=True)
    _write(out / f"node-{index}.pub", public + b"\n")


def _load_ca(out: Path) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    if not (out / "ca.key").is_file():
        raise SystemExit(
            f"{out / 'ca.key'} is missing: re-issuing a certificate needs the CA key (run this where it is kept)"
        )
    key = serialization.load_pem_private_key((out / "ca.key").read_bytes(), None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise SystemExit(f"{out / 'ca.key'} is not an EC key: re-create the CA with --force")
    return key, x509.load_pem_x509_certificate((out / "ca.crt").read_bytes())


def ca_renewal_reason(ca_cert: x509.Certificate) -> str | None:
    """Why ``--renew`` re-issues this CA too, or None when it does not need to."""
    kinds = {type(ext.value) for ext in ca_cert.extensions}
    if not {x509.SubjectKeyIdentifier, x509.KeyUsage} <= kinds:
        return (
            "it has no key identifier or key usage (made by an earlier deploy/certs.py): nodes on Python 3.13+ refuse "
            "the old ca.crt, others accept it until it expires"
        )
    expiry = ca_cert.not_valid_after_utc
    if expiry < dt.datetime.now(dt.timezone.utc) + dt.timedelta(days=SERVER_DAYS):
        return (
            f"it expires on {expiry:%Y-%m-%d}, before a new {SERVER_DAYS}-day server certificate would: "
            "the old ca.crt is accepted until then"
        )
    return None


def generate(
    out: Path, hosts: list[str], nodes: int, force: bool = False, renew: bool = False, renew_ca: bool = False
) -> Path:
    """Write whatever is missing in ``out`` (everything with ``force``). A server certificate for other ``hosts``,
    or any with ``renew``, is re-issued by the same CA; with ``renew`` the CA is re-issued too, keeping its key, when
    ``ca_renewal_reason`` gives a reason or with ``renew_ca``. Node keys are only ever created, never replaced
    (except with ``force``)."""
    out.mkdir(parents=True, exist_ok=True)
    if force or not (out / "ca.crt").exists():
        ca_key, ca_cert = make_ca(out)
        make_server_cert(out, ca_key, ca_cert, hosts)
    elif renew or renew_ca or not (out / "server.pem").exists() or _server_names(out / "server.pem") != set(hosts):
        # re-issued by the same CA: registered nodes, and the ca.crt they hold, stay valid
        ca_key, ca_cert = _load_ca(out)
        if renew_ca or (renew and ca_renewal_reason(ca_cert)):
            ca_key, ca_cert = make_ca(out, key=ca_key, name=ca_cert.subject)
        make_server_cert(out, ca_key, ca_cert, hosts)
    for i in range(nodes):
        if force or not (out / f"node-{i}.key").exists():
            make_node_keys(out, i)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="deploy/certs", help="output directory (default: deploy/certs)")
    parser.add_argument(
        "--hosts",
        help=f"comma-separated names/IPs the SuperLink is reached by (default: {DEFAULT_HOSTS}; "
        "with --renew, the current certificate's)",
    )
    parser.add_argument("--nodes", type=int, default=3, help="number of SuperNode key pairs")
    parser.add_argument("--force", action="store_true", help="overwrite existing files")
    parser.add_argument(
        "--renew",
        action="store_true",
        help=f"re-issue the server certificate ({SERVER_DAYS} days), and the CA with its key when it is due; "
        "node keys are kept",
    )
    parser.add_argument(
        "--renew-ca", action="store_true", help="re-issue the CA (same key and name) even when not due; implies --renew"
    )
    args = parser.parse_args(argv)
    out = Path(args.out)
    renew = args.renew or args.renew_ca
    existing = not args.force and (out / "ca.crt").exists()
    if args.hosts is None and renew and existing and (out / "server.pem").exists():
        hosts = _server_name_list(out / "server.pem")
    else:
        hosts = [h.strip() for h in (args.hosts or DEFAULT_HOSTS).split(",") if h.strip()]
    if not hosts:
        parser.error("--hosts names no host")
    ca_before = (out / "ca.crt").read_bytes() if existing else None
    reason = ca_renewal_reason(x509.load_pem_x509_certificate(ca_before)) if ca_before and renew else None
    reason = reason or "as asked with --renew-ca: the old ca.crt is accepted until it expires"
    generate(out, hosts, args.nodes, args.force, renew, args.renew_ca)
    print(f"certificates and node keys in {out.resolve()}")
    if renew and existing:
        print(f"server certificate re-issued for {', '.join(hosts)}; node keys kept")
        if (out / "ca.crt").read_bytes() != ca_before:
            print(f"CA re-issued with its key and name, {reason}; copy the new ca.crt to every node")
        else:
            print("CA kept")


if __name__ == "__main__":
    main()
