"""Who may call what on the router's front doors: bearer tokens, their roles, the access rules.

Tokens come from `router.auth.tokens_file` (traffic) and `admin_tokens_file` (admin; an admin
token is accepted for traffic too), one per line. Only their SHA-256 digests are kept: a
presented token is hashed once and compared with every digest by `hmac.compare_digest`, all of
them, equal lengths, no early exit, so the time taken tells nothing about which token (or how
much of one) matched. `Gate.reload()` (SIGHUP) re-reads both files; a file that cannot be read
keeps the tokens in use. No token ever reaches a log line or an error message.

Needs: OPEN (health), TRAFFIC (generation), ADMIN (anything that changes the cluster) and
STATUS (Admin/Status, reflection, /metrics), which `status_access` maps to: `loopback` (no token
from this machine, else an admin identity), `admin`, or `traffic`. An admin identity is an admin
token, or a client certificate (mutual TLS) whose subject is on `router.auth.admin_subjects`:
with mutual TLS any client the CA signed may send traffic, but only those may administer. With
neither token files nor mutual TLS the gate is off and every call is allowed (a loopback-only
router, or --insecure).

A call with two or more Authorization values (headers, or gRPC metadata entries) is refused
UNAUTHENTICATED / 401 whether or not the gate is on: the one checked and the one that names the
caller must be the same. `caller_id`: who a request comes from (a token's digest, else a certificate subject), the
namespace of its request ids and, with `isolate_prefix_cache`, of its prefix-cache blocks.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import ipaddress
import logging
from collections.abc import Callable
from pathlib import Path
from urllib.parse import unquote

log = logging.getLogger(__name__)

MIN_TOKEN_CHARS = 16


class TokenFileError(ValueError):
    """A tokens file that cannot be used; the message names the file and line, never a token."""


class Role(enum.IntEnum):
    NONE = 0
    TRAFFIC = 1
    ADMIN = 2


class Need(enum.Enum):
    OPEN = "open"
    TRAFFIC = "traffic"
    STATUS = "status"
    ADMIN = "admin"


class Verdict(enum.Enum):
    ALLOW = "allow"
    UNAUTHENTICATED = "missing or invalid token"
    AMBIGUOUS = "more than one authorization value: send exactly one"
    DENIED = "this call needs an admin token or an admin client certificate"


def read_tokens(path: str) -> list[bytes]:
    """The tokens of a file: one per line; blank lines and lines starting with # are skipped."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise TokenFileError(f"{path}: cannot read: {e.strerror}") from None
    except UnicodeDecodeError:
        raise TokenFileError(f"{path}: not UTF-8 text") from None
    tokens = []
    for number, line in enumerate(text.splitlines(), 1):
        token = line.strip()
        if not token or token.startswith("#"):
            continue
        if len(token) < MIN_TOKEN_CHARS or not (token.isascii() and token.isprintable()) or " " in token:
            raise TokenFileError(f"{path}: line {number}: a token is at least {MIN_TOKEN_CHARS} printable "
                                 "ASCII characters without spaces")
        tokens.append(token.encode())
    if not tokens:
        raise TokenFileError(f"{path}: no tokens (one per line)")
    return tokens


def _digests(path: str | None) -> tuple[bytes, ...]:
    return () if path is None else tuple(hashlib.sha256(t).digest() for t in read_tokens(path))


def _any_equal(digest: bytes, digests: tuple[bytes, ...]) -> bool:
    found = False
    for candidate in digests:  # every one, whatever matched before
        found |= hmac.compare_digest(candidate, digest)
    return found


def bearer(authorization: str | bytes | None) -> bytes | None:
    """The token of an `Authorization: Bearer TOKEN` value (the scheme is case-insensitive)."""
    if authorization is None:
        return None
    value = authorization.encode("latin-1", "replace") if isinstance(authorization, str) else authorization
    scheme, _, token = value.strip().partition(b" ")
    return (token.strip() or None) if scheme.lower() == b"bearer" else None


def is_loopback(host: str) -> bool:
    """An IP address of this machine's loopback interface (a name is never trusted as one)."""
    try:
        return ipaddress.ip_address(host.strip("[]").split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def grpc_peer_is_loopback(peer: str) -> bool:
    """`ServicerContext.peer()`: "ipv4:127.0.0.1:5000", "ipv6:[::1]:5000" (maybe %-encoded)."""
    kind, _, rest = unquote(peer).partition(":")
    return kind in ("ipv4", "ipv6") and is_loopback(rest.rsplit(":", 1)[0])


class Gate:
    """The front doors' one access decision; `enabled` is False without token files or mutual TLS."""

    def __init__(self, tokens_file: str | None = None, admin_tokens_file: str | None = None,
                 status_access: str = "loopback", mutual_tls: bool = False, admin_subjects: tuple[str, ...] = ()):
        self.files = (tokens_file, admin_tokens_file)
        self.has_tokens = any(self.files)
        self.enabled = self.has_tokens or mutual_tls
        self.status_access = status_access
        self.admin_subjects = frozenset(admin_subjects)
        self._digests = (_digests(tokens_file), _digests(admin_tokens_file))  # (traffic, admin), swapped whole

    @classmethod
    def from_config(cls, router) -> Gate:
        """`router`: the config's `router` section (its auth and tls)."""
        auth = router.auth
        return cls(auth.tokens_file, auth.admin_tokens_file, auth.status_access,
                   router.tls.client_ca_file is not None, tuple(auth.admin_subjects))

    def reload(self) -> bool:
        """Re-read the token files; on any error keep the tokens in use and log why."""
        if not self.has_tokens:
            log.info("auth: no router.auth token files to re-read")
            return False
        try:
            digests = (_digests(self.files[0]), _digests(self.files[1]))
        except TokenFileError as e:
            log.error("auth: tokens NOT reloaded, the previous ones stay in use: %s", e)
            return False
        self._digests = digests
        log.info("auth: reloaded %d traffic and %d admin tokens", *map(len, digests))
        return True

    def role(self, authorization: str | bytes | None) -> Role:
        token = bearer(authorization)
        if token is None:
            return Role.NONE
        digest = hashlib.sha256(token).digest()
        traffic, admin = self._digests
        is_admin, is_traffic = _any_equal(digest, admin), _any_equal(digest, traffic)
        return Role.ADMIN if is_admin else Role.TRAFFIC if is_traffic else Role.NONE

    def check(self, need: Need, authorization: str | bytes | None,
              loopback: Callable[[], bool] = lambda: False,
              subject: Callable[[], str | None] = lambda: None) -> Verdict:
        """May a call with this Authorization value, from a peer `loopback()` says is local and whose
        client certificate has `subject()` (None: none shown), go on?"""
        if not self.enabled or need is Need.OPEN:
            return Verdict.ALLOW
        if need is Need.STATUS:
            if self.status_access == "loopback" and loopback():
                return Verdict.ALLOW
            need = Need.TRAFFIC if self.status_access == "traffic" else Need.ADMIN
        if need is Need.ADMIN and self.admin_subjects and subject() in self.admin_subjects:
            return Verdict.ALLOW
        if not self.has_tokens:  # mutual TLS alone: the handshake admitted the client for traffic
            return Verdict.ALLOW if need is Need.TRAFFIC else Verdict.DENIED
        role = self.role(authorization)
        if role is Role.NONE:
            return Verdict.UNAUTHENTICATED
        return Verdict.DENIED if need is Need.ADMIN and role is not Role.ADMIN else Verdict.ALLOW


class AmbiguousCredentials(ValueError):
    """A call with more than one Authorization value: which one names the caller is ambiguous, so
    none does (a gate could check one while the caller's namespace came from another)."""


def sole_authorization(values: list) -> str | bytes | None:
    """The one Authorization value of a call (None without one); AmbiguousCredentials for several."""
    if len(values) > 1:
        raise AmbiguousCredentials(Verdict.AMBIGUOUS.value)
    return values[0] if values else None


def caller_id(authorization: str | bytes | None, subject: str | None = None) -> str:
    """Who a call comes from, for namespacing: "token:" and a digest of its bearer token (never the
    token itself), else "cert:" and its client certificate's subject, else "" (anonymous)."""
    token = bearer(authorization)
    if token is not None:
        return "token:" + hashlib.sha256(b"pdserve-caller" + token).hexdigest()[:32]
    return f"cert:{subject}" if subject else ""
