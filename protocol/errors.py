"""Errors that cross process boundaries: refusals meant for the person who sent the request."""

from __future__ import annotations


class InvalidRequest(ValueError):
    """A request the engine refuses; the message is meant for the person who sent it."""
