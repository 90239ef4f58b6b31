"""How the pool manager starts, kills and places its workers: Ray actors on a live cluster.

`Actors` is the interface `PoolManager` uses; `RayActors` is the live one. A worker handle
answers `handle.method.remote(...)` with an awaitable, as a Ray actor handle does, so the
router's own code runs unchanged over another implementation (simulate/actors.py runs workers
in-process on a virtual clock).
"""

from __future__ import annotations

from typing import Any, Protocol

import ray

from router.config.schema import PoolSection
from router.lifecycle.outcomes import CannotPlace


class Actors(Protocol):
    def start(self, cls: type, sec: PoolSection, env: dict[str, str], args: tuple) -> Any:
        """A handle of a new worker `cls(*args)` placed as `sec` says (`env`: its process's variables)."""

    def kill(self, actor: Any) -> None:
        """The worker's process is gone (no restart)."""

    def check_placeable(self, pool: str, sec: PoolSection, count: int) -> None:
        """CannotPlace unless `count` more of the pool's workers can be placed."""


class RayActors:
    def start(self, cls: type, sec: PoolSection, env: dict[str, str], args: tuple) -> Any:
        return ray.remote(cls).options(
            name=None, max_concurrency=1000, max_restarts=0, **_placement(sec),
            **({"runtime_env": {"env_vars": env}} if env else {}),
        ).remote(*args)

    def kill(self, actor: Any) -> None:
        ray.kill(actor, no_restart=True)

    def check_placeable(self, pool: str, sec: PoolSection, count: int) -> None:
        wanted = {"CPU": sec.num_cpus, "GPU": sec.num_gpus, **sec.resources}
        available = ray.available_resources()
        for resource, each in wanted.items():
            need, have = each * count, available.get(resource, 0.0)
            if each > 0 and need > have:
                raise CannotPlace(f"cannot start {count} more {pool} worker(s): they need {need:g} {resource} "
                                  f"but the Ray cluster has {have:g} {resource} available")
        nodes = [n for n in ray.nodes() if n["Alive"]]
        if sec.label_selector and not any(labels_match(sec.label_selector, n.get("Labels") or {}) for n in nodes):
            raise CannotPlace(f"cannot start {count} more {pool} worker(s): no live Ray node has labels matching "
                              f"{pool}.label_selector {sec.label_selector} (nodes: "
                              + "; ".join(f"{n['NodeManagerAddress']} {_shown_labels(n)}" for n in nodes) + ")")


def _placement(sec: PoolSection) -> dict:
    """The Ray options that say where a pool's workers may run."""
    options = {"num_cpus": sec.num_cpus, "num_gpus": sec.num_gpus, "resources": dict(sec.resources) or None}
    if sec.label_selector:  # passed only when set: older Rays have no such option
        options["label_selector"] = dict(sec.label_selector)
    return options


def _shown_labels(node: dict) -> dict[str, str]:
    return {k: v for k, v in (node.get("Labels") or {}).items() if k != "ray.io/node-id"}  # ids only add noise


def labels_match(selector: dict[str, str], labels: dict[str, str]) -> bool:
    """Ray's label-selector semantics: each key's node label is `value`, not `!value`, one of
    `in(a,b)`, or none of `!in(a,b)`."""
    for key, want in selector.items():
        negate, want = want.startswith("!"), want.removeprefix("!")
        values = {v.strip() for v in want[3:-1].split(",")} if want.startswith("in(") else {want}
        if (labels.get(key) in values) == negate:
            return False
    return True

