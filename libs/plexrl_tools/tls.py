"""A throwaway certificate authority for TLS tests and trials: a CA, a server
certificate for given addresses, and a client certificate, made with the `openssl`
command (PEM files, unencrypted keys, valid for a day).

For tests that run Kafka, Redis or the object store with TLS on one machine; a real
deployment uses its own CA (docs/deploy.md).
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Pki:
    """The files `make_pki` wrote."""

    ca: Path
    """The CA's certificate: what clients and servers trust."""
    server_cert: Path
    server_key: Path
    server_pem: Path
    """The server's key, then its certificate: one file (a Kafka PEM keystore)."""
    client_cert: Path
    client_key: Path


def _openssl(*args: str) -> None:
    done = subprocess.run(["openssl", *args], capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args[:2])} failed: {done.stderr[-2000:]}")


def make_pki(directory: Path, addresses: tuple[str, ...] = ("127.0.0.1",)) -> Pki:
    """Write a CA, a server certificate naming `addresses` (IPs or host names) and a
    client certificate (CN `plexrl`), all signed by the CA, under `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    d = directory
    _openssl(
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
        "-subj", "/CN=plexrl-test-ca", "-keyout", str(d / "ca.key"), "-out", str(d / "ca.pem"),
    )  # fmt: skip
    names = ",".join(
        f"IP:{a}" if a.replace(".", "").isdigit() or ":" in a else f"DNS:{a}" for a in addresses
    )
    for role, subject, usage in (
        ("server", f"/CN={addresses[0]}", "serverAuth"),
        ("client", "/CN=plexrl", "clientAuth"),
    ):
        extensions = d / f"{role}.ext"
        lines = [f"extendedKeyUsage={usage}"]
        if role == "server":
            lines.append(f"subjectAltName={names}")
        extensions.write_text("\n".join(lines) + "\n")
        _openssl(
            "req", "-newkey", "rsa:2048", "-nodes", "-subj", subject,
            "-keyout", str(d / f"{role}.key"), "-out", str(d / f"{role}.csr"),
        )  # fmt: skip
        _openssl(
            "x509", "-req", "-in", str(d / f"{role}.csr"), "-days", "1",
            "-CA", str(d / "ca.pem"), "-CAkey", str(d / "ca.key"), "-CAcreateserial",
            "-extfile", str(extensions), "-out", str(d / f"{role}.pem"),
        )  # fmt: skip
    server_pem = d / "server-key-and-cert.pem"
    server_pem.write_text((d / "server.key").read_text() + (d / "server.pem").read_text())
    return Pki(
        ca=d / "ca.pem",
        server_cert=d / "server.pem",
        server_key=d / "server.key",
        server_pem=server_pem,
        client_cert=d / "client.pem",
        client_key=d / "client.key",
    )
