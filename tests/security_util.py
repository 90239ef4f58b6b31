"""Throw-away certificates and token files for the security tests (docs/security.md)."""

from __future__ import annotations

import subprocess
from pathlib import Path

TRAFFIC, ADMIN, ROTATED = "traffic-0123456789abcdef", "admin-0123456789abcdef", "rotated-0123456789abcdef"
ADMIN_SUBJECT = "CN=pdserve test admin"  # admin.pem's subject as gRPC writes it


def _openssl(cwd: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_pki(d: Path) -> Path:
    """ca.pem; server.pem/.key for localhost and 127.0.0.1; client.pem/.key and admin.pem/.key
    (clientAuth; subjects "CN=pdserve test client" and ADMIN_SUBJECT)."""
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl(d, "req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=pdserve test CA",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign")
    for name, ext in (("server", "extendedKeyUsage=serverAuth\nsubjectAltName=DNS:localhost,IP:127.0.0.1\n"),
                      ("client", "extendedKeyUsage=clientAuth\n"), ("admin", "extendedKeyUsage=clientAuth\n")):
        _openssl(d, "req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN=pdserve test {name}")
        (d / f"{name}.ext").write_text(ext)
        _openssl(d, "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext")
    return d


def token_files(d: Path) -> tuple[Path, Path]:
    """traffic.txt (TRAFFIC, with a comment and a blank line) and admin.txt (ADMIN) in `d`."""
    traffic, admin = d / "traffic.txt", d / "admin.txt"
    traffic.write_text(f"# traffic tokens\n{TRAFFIC}\n\n")
    admin.write_text(f"{ADMIN}\n")
    return traffic, admin
