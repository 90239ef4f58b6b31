"""What a client may read of a server-side failure: the sentence, without the cluster's insides.

A router refusal (Unavailable, InternalError, QueueFull, CannotPlace) often carries what the
router knows: a worker's name, a node's IP address and port, a path on the server, a Ray id.
`public_message` keeps the sentence and the cause's words ("injected transfer failure", "ran out
of memory") but writes each of those as what it is ("a decode worker", "an internal address"),
and cuts it at MAX_CHARS. The full text stays in the router's log. A client's own bad input
(InvalidRequest) names only what the client sent and passes unchanged.
"""

from __future__ import annotations

import logging
import re

log = logging.getLogger(__name__)

MAX_CHARS = 400
_SCRUB = [
    (re.compile(r"\b(prefill|decode)-\d+\b"), r"a \1 worker"),
    (re.compile(r"\[[0-9a-fA-F:.%\w]*:[0-9a-fA-F:.%\w]*\](:\d+)?"), "an internal address"),  # [IPv6]:port
    (re.compile(r"\b(?:\d{1,3}\.){3}\d{1,3}(?::\d+)?\b"), "an internal address"),  # IPv4[:port]
    (re.compile(r"\b(?:[a-z0-9-]+\.)+[a-z]{2,}:\d+\b", re.I), "an internal address"),  # host.domain:port
    (re.compile(r"\blocalhost:\d+\b"), "an internal address"),
    (re.compile(r"(?:/[\w.@+-]+){2,}/?"), "a server path"),
    (re.compile(r"\b(?:\d+\.)*[0-9a-f]{24,}\b"), "an internal id"),  # Ray ids, request keys
]


def public_message(text: str) -> str:
    """`text` as a client may read it; when that differs, the full text goes to the log (INFO)."""
    public = text
    for pattern, replacement in _SCRUB:
        public = pattern.sub(replacement, public)
    public = public if len(public) <= MAX_CHARS else public[:MAX_CHARS - 3] + "..."
    if public != text:
        log.info("a client was told %r; in full: %s", public, text)
    return public
