"""What a prefill worker raises to the router, in a module of its own: the router imports these
to tell a request's failure from a worker's without importing the engine."""

from __future__ import annotations


class PrefillFailed(RuntimeError):
    """The engine failed on this request (not the worker): the router does not retry it."""


class PrefillStepFailed(RuntimeError):
    """The engine step this prefill was in failed, not because of it: the router moves it."""
