"""Certificates and keys for a TLS-authenticated Flower deployment, made with `cryptography` (no openssl).

    python -m deploy.certs --out deploy/certs --hosts 127.0.0.1,localhost,superlink.example.org --nodes 3

writes
- ``ca.crt`` / ``ca.key`` — a self-signed CA (keep ``ca.key`` offline in a real deployment);
- ``server.pem`` / ``server.key`` — the SuperLink's TLS certificate, valid for every name in ``--hosts``;
- ``node-<i>.key`` / ``node-<i>.pub`` — per-SuperNode EC P-384 key pairs in OpenSSH format, the format
  ``flower-supernode --auth-supernode-private-key`` and ``flwr supernode register`` read.
Existing files are kept unless ``--force`` is given, so re-running never invalidates registered nodes.
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
from cryptography.x509.oid import NameOID


def _write(path: Path, data: bytes, private: bool = False) -> None:
    """Write ``data`` to a fresh file created with its final mode (0600 for keys: never readable by others, not
    even briefly), then renamed over ``path``: an existing file or symlink there is replaced, never followed."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
    os.replace(tmp, path)


def _server_names(cert_path: Path) -> set[str]:
    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return {str(n.value) for n in names}


def _key_pem(key) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def make_ca(out: Path, days: int = 825):
    key = ec.generate_private_key(ec.SECP384R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "Tessera federation CA")])
    now = dt.datetime.now(dt.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(key, hashes.SHA384())
    )
    _write(out / "ca.key", _key_pem(key), private=True)
    _write(out / "ca.crt", cert.public_bytes(serialization.Encoding.PEM))
    return key, cert


def make_server_cert(out: Path, ca_key, ca_cert, hosts: list[str], days: int = 825) -> None:
    key = ec.generate_private_key(ec.SECP384R1())
    alt_names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            alt_names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            alt_names.append(x509.DNSName(host))
    now = dt.datetime.now(dt.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
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


def generate(out: Path, hosts: list[str], nodes: int, force: bool = False) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    if force or not (out / "ca.crt").exists():
        ca_key, ca_cert = make_ca(out)
        make_server_cert(out, ca_key, ca_cert, hosts)
    elif not (out / "server.pem").exists() or _server_names(out / "server.pem") != set(hosts):
        # new --hosts: the server certificate is re-issued by the same CA (registered nodes stay valid)
        ca_key = serialization.load_pem_private_key((out / "ca.key").read_bytes(), None)
        make_server_cert(out, ca_key, x509.load_pem_x509_certificate((out / "ca.crt").read_bytes()), hosts)
    for i in range(nodes):
        if force or not (out / f"node-{i}.key").exists():
            make_node_keys(out, i)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="deploy/certs", help="output directory (default: deploy/certs)")
    parser.add_argument(
        "--hosts", default="127.0.0.1,localhost", help="comma-separated names/IPs the SuperLink is reached by"
    )
    parser.add_argument("--nodes", type=int, default=3, help="number of SuperNode key pairs")
    parser.add_argument("--force", action="store_true", help="overwrite existing files")
    args = parser.parse_args()
    out = generate(Path(args.out), [h.strip() for h in args.hosts.split(",") if h.strip()], args.nodes, args.force)
    print(f"certificates and node keys in {out.resolve()}")


if __name__ == "__main__":
    main()
