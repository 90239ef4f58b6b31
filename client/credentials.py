"""Client side of the router's security: where a router is and how to prove who we are.

`Target` is an address plus TLS material (a CA to trust, a client certificate for mutual TLS)
and a bearer token; every client (the CLI, `pdserve bench` over gRPC or HTTP, the scripts)
builds its channel and call metadata from one. `add_flags` gives a command the same options:
--token (default $PDSERVE_TOKEN: a token on a command line is visible to every user of the
machine), --ca-file, --cert-file/--key-file, --tls.
"""

from __future__ import annotations

import argparse
import os
import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc

TOKEN_ENV = "PDSERVE_TOKEN"


class CredentialsError(ValueError):
    """A TLS file that cannot be read, or flags that do not fit; one line for the user."""


@dataclass(frozen=True)
class Target:
    address: str
    token: str | None = None
    ca_file: str | None = None  # trust this CA (else the system's, with tls=True)
    cert_file: str | None = None  # mutual TLS: our certificate and key
    key_file: str | None = None
    tls: bool = False

    def __str__(self) -> str:
        return self.address

    @property
    def secure(self) -> bool:
        return self.tls or self.ca_file is not None or self.cert_file is not None

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """gRPC call metadata (sent on plaintext channels too: a loopback router, a TLS proxy)."""
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def grpc_credentials(self) -> grpc.ChannelCredentials | None:
        """None for a plaintext channel."""
        if not self.secure:
            return None
        ca, key, cert = (_read(flag, path) for flag, path in (("--ca-file", self.ca_file),
                                                              ("--key-file", self.key_file),
                                                              ("--cert-file", self.cert_file)))
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)

    def ssl_context(self) -> ssl.SSLContext | None:
        """For an HTTPS client; None for plain HTTP."""
        if not self.secure:
            return None
        try:
            context = ssl.create_default_context(cafile=self.ca_file)
            if self.cert_file is not None:
                context.load_cert_chain(self.cert_file, self.key_file)
        except (OSError, ssl.SSLError) as e:
            raise CredentialsError(f"TLS files: {e}") from None
        return context

    def grpc_channel(self, options=()) -> grpc.Channel:
        creds = self.grpc_credentials()
        if creds is None:
            return grpc.insecure_channel(self.address, options=options)
        return grpc.secure_channel(self.address, creds, options=options)

    def aio_channel(self, options=()) -> grpc.aio.Channel:
        creds = self.grpc_credentials()
        if creds is None:
            return grpc.aio.insecure_channel(self.address, options=options)
        return grpc.aio.secure_channel(self.address, creds, options=options)


def as_target(target: Target | str) -> Target:
    return target if isinstance(target, Target) else Target(target)


def _read(flag: str, path: str | None) -> bytes | None:
    try:
        return None if path is None else Path(path).read_bytes()
    except OSError as e:
        raise CredentialsError(f"{flag} {path}: cannot read: {e.strerror}") from None


def add_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("router security (docs/security.md)")
    group.add_argument("--token", default=os.environ.get(TOKEN_ENV),
                       help=f"bearer token for a router with router.auth (default: ${TOKEN_ENV})")
    group.add_argument("--ca-file", help="TLS: trust the router's certificate when this CA signed it (PEM)")
    group.add_argument("--cert-file", help="mutual TLS: this client's certificate (PEM), with --key-file")
    group.add_argument("--key-file", help="mutual TLS: this client's private key (PEM)")
    group.add_argument("--tls", action="store_true", help="TLS with the system's CAs (implied by --ca-file)")


def target_from_args(address: str, args: argparse.Namespace) -> Target:
    if (args.cert_file is None) != (args.key_file is None):
        raise CredentialsError("--cert-file and --key-file go together (mutual TLS)")
    return Target(address, args.token or None, args.ca_file, args.cert_file, args.key_file, args.tls)
