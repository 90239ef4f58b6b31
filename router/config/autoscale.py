"""`router.autoscale:` in cluster.yaml: the SLO planner's targets, bounds, budget and pacing
(docs/autoscale.md); router/config/checks.py checks it. Off by default.

A bad value is a ConfigError naming the key (the CLI exits 2). `measured_profile` names a file
holding the `emulate:` section `pdserve plan --measure` prints (this host's fitted cost model),
read and checked at load like the router's TLS files.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import yaml

from router.config.emulate import EmulateSection
from router.config.typed_yaml import ConfigError, build

Profile = Literal["cost_model", "measured", "online"]


@dataclass(frozen=True)
class AutoscaleSection:
    """The planner (router/autoscale/): every `interval_s` it sizes each pool for the next
    interval's load against the SLOs, within min/max and the budget."""

    enabled: bool = False
    ttft_s: float = 2.0  # SLO: time to first token, at `percentile`
    itl_s: float = 0.05  # SLO: gap between two tokens of a request, at `percentile`
    percentile: float = 90.0  # of requests (TTFT) / token gaps (ITL) that must meet the SLO
    prefill_min: int = 1  # disaggregated only (colocated has no prefill pool)
    prefill_max: int = 8
    decode_min: int = 1
    decode_max: int = 8
    max_workers: int | None = None  # both pools together; null = only the per-pool max
    max_cost_per_hour: float | None = None  # both pools together, at cost_per_worker_hour; null = no limit
    cost_per_worker_hour: float = 1.0  # what one worker (one device) costs an hour, in your currency
    interval_s: float = 10.0  # one decision per interval; its observation window is the interval
    scale_up_cooldown_s: float = 30.0  # after a change to a pool, no SLO-driven step up of it for this long
    scale_down_cooldown_s: float = 120.0  # after a change, no scale-down for this long; a scale-down
    # plans for this long's work (its mean load, backlogs included) and its highest arrival rate
    band: float = 0.2  # hysteresis: scale down only to a size the load fills at most (1 - band) x target_utilization
    target_utilization: float = 0.8  # share of a worker's modelled capacity the planner fills
    kv_high: float = 0.9  # decode KV use (blocks used / total) above which decode is full
    warmup_s: float = 30.0  # a worker younger than this is not capacity and its steps are ignored
    # where a worker's capacity comes from: cost_model (the emulate: section's device x model), measured
    # (measured_profile: `pdserve plan --measure`'s fit of this host), online (fitted to the workers'
    # own step records; the cost model, when emulating, until enough steps are seen). Every source is
    # corrected online by the ratio of the workers' measured step times to the profile's.
    profile: Profile = "online"
    measured_profile: str | None = None  # file with the emulate: section `pdserve plan --measure` printed
    # one pool growing while the other shrinks: move an idle worker of the shrinking pool across by a
    # role change (weights kept loaded: docs/roles.md) instead of starting one, where the pools allow it
    role_change: bool = True

    @property
    def budget_workers(self) -> int | None:
        """The total worker budget: max_workers and max_cost_per_hour together (None: none)."""
        limits = [self.max_workers] if self.max_workers is not None else []
        if self.max_cost_per_hour is not None:
            limits.append(int(self.max_cost_per_hour // self.cost_per_worker_hour))
        return min(limits) if limits else None


def read_measured_profile(path: str, block_size: int, where: str) -> EmulateSection:
    """The `emulate:` section in `path` (YAML or JSON: the section itself, or a mapping holding it
    under `emulate`), checked; ConfigError naming router.autoscale.measured_profile."""
    from router.config.emulate import check_emulate  # the checks read the cost model

    key = f"{where}: router.autoscale.measured_profile"
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise ConfigError(f"{key}: {path}: cannot read: {e.strerror}") from None
    except (yaml.YAMLError, json.JSONDecodeError) as e:
        raise ConfigError(f"{key}: {path}: not YAML or JSON: {e}") from None
    if isinstance(raw, dict) and isinstance(raw.get("emulate"), dict):
        raw = raw["emulate"]
    section = build(EmulateSection, raw, "emulate.", f"{key}: {path}")
    if section.device is None:
        raise ConfigError(f"{key}: {path}: emulate.device is null: no profile in it")
    check_emulate(section, block_size, f"{key}: {path}")
    return section
