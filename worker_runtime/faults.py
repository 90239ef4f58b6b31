"""Fault injection for tests and the chaos soak: off by default, set by `cluster.yaml`'s
`faults:` section or the `PDSERVE_FAULTS` environment variable of the router process.

Each worker gets a `Faults` with its own seeded RNG. Hooks, each a no-op when its knob is 0:
  fail_transfer()      a KV send fails before its header reaches the decode worker
  transfer_delay()     seconds to wait before a KV send (a slow link)
  before_step(engine)  before each engine step: sleeps `step_delay_s` (a slow worker); blocks
                       the engine thread for `stall_engine_s` (a step stuck in a CUDA or NCCL
                       call; set 0 again to let it go); fails the next `fail_steps` steps, naming
                       the running request with the longest context as the culprit when
                       `fail_culprit` is "longest" (a long chunk's CUDA OOM)
  before_forward(items) before each forward (inside the step, engine.before_forward): fails
                       every forward whose batch holds a request with `poison_token` in its
                       prompt, naming no culprit (a request that breaks the model, as a NaN
                       trap or a kernel bug on one shape would)
  refuse_reserve()     a decode reservation answers "no room" though the blocks fit (the
                       router's view of free blocks gone stale)
  maybe_kill(point)    the worker process exits at a named lifecycle point (see KILL_POINTS)
`PDSERVE_FAULTS="transfer_fail_rate=0.1,kill_at=decode.after_start,kill_rate=0.5"` overrides
the config's values key by key. Tests change a running worker's knobs with `Faults.set` (the
workers' `set_faults` call, `PoolManager.set_faults` for a whole cluster).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import time
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the config half (FaultConfig) is read by the router's config loader, without torch
    from engine.llm_engine import LLMEngine
    from engine.request import ScheduledItem

log = logging.getLogger(__name__)
ENV_VAR = "PDSERVE_FAULTS"
CULPRITS = ("", "longest")
KILL_POINTS = ("prefill.after_first_token", "decode.after_reserve", "decode.after_start",
               "decode.mid_stream")


@dataclass(frozen=True)
class FaultConfig:
    seed: int = 0
    transfer_fail_rate: float = 0.0   # fraction of KV sends failed before the header goes out
    transfer_delay_rate: float = 0.0  # fraction of KV sends delayed by transfer_delay_s
    transfer_delay_s: float = 0.0
    step_delay_s: float = 0.0         # added before every engine step
    stall_engine_s: float = 0.0       # the engine thread blocks this long at its next step
    fail_steps: int = 0               # the next this many engine steps fail
    fail_culprit: str = ""            # "longest": a failed step names the longest running request
    poison_token: int = -1            # >= 0: every forward holding a prompt with this token id fails
    reserve_refuse_rate: float = 0.0  # fraction of decode reservations refused though they fit
    kill_at: str = ""                 # one of KILL_POINTS; "" = never
    kill_rate: float = 0.0            # probability of exiting at each pass through kill_at

    def problems(self) -> list[tuple[str, str]]:
        """(key, reason) for each impossible value."""
        out = [(k, "must be in [0, 1]") for k in ("transfer_fail_rate", "transfer_delay_rate", "kill_rate",
                                                  "reserve_refuse_rate") if not 0.0 <= getattr(self, k) <= 1.0]
        out += [(k, "must be >= 0") for k in ("transfer_delay_s", "step_delay_s", "stall_engine_s", "fail_steps")
                if getattr(self, k) < 0]
        if self.poison_token < -1:
            out.append(("poison_token", "must be a token id, or -1 for none"))
        if self.fail_culprit not in CULPRITS:
            out.append(("fail_culprit", f"must be one of {', '.join(repr(c) for c in CULPRITS)}"))
        if self.kill_at and self.kill_at not in KILL_POINTS:
            out.append(("kill_at", f"must be one of {', '.join(KILL_POINTS)} (or empty)"))
        return out

    def with_env(self, env: str | None = None) -> FaultConfig:
        """This config overridden by `PDSERVE_FAULTS` (key=value pairs, comma-separated)."""
        text = os.environ.get(ENV_VAR, "") if env is None else env
        fields = {f.name: f.type for f in dataclasses.fields(self)}
        values = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, sep, value = item.partition("=")
            if not sep or key not in fields:
                raise ValueError(f"{ENV_VAR}: {item!r} is not KEY=VALUE with KEY one of {', '.join(fields)}")
            cast = {"int": int, "float": float}.get(str(fields[key]), str)
            try:
                values[key] = cast(value)
            except ValueError:
                raise ValueError(f"{ENV_VAR}: {key}: {value!r} is not a {cast.__name__}") from None
        merged = dataclasses.replace(self, **values)
        bad = merged.problems()
        if bad:
            raise ValueError(f"{ENV_VAR}: {bad[0][0]}: {bad[0][1]}")
        return merged


class Faults:
    def __init__(self, config: FaultConfig | None, worker: str):
        self.worker = worker
        self.set(config or FaultConfig())

    def set(self, config: FaultConfig) -> None:
        """Replace the knobs (at run time too: every hook reads them when it runs); the RNG starts
        again from the new seed."""
        self.config = config
        self._steps_failed = 0
        self._rng = random.Random(config.seed * 1_000_003 + zlib.crc32(self.worker.encode()))

    def _hit(self, rate: float) -> bool:
        return rate > 0 and self._rng.random() < rate

    def fail_transfer(self) -> bool:
        return self._hit(self.config.transfer_fail_rate)

    def refuse_reserve(self) -> bool:
        return self._hit(self.config.reserve_refuse_rate)

    def transfer_delay(self) -> float:
        return self.config.transfer_delay_s if self._hit(self.config.transfer_delay_rate) else 0.0

    def before_step(self, engine: LLMEngine) -> None:
        """On the engine thread before each step (worker_runtime/engine_loop.py)."""
        if self.config.step_delay_s > 0:
            time.sleep(self.config.step_delay_s)
        self._stall()
        if self._steps_failed < self.config.fail_steps:
            self._steps_failed += 1
            self._fail_step(engine)

    def before_forward(self, items: list[ScheduledItem]) -> None:
        """On the engine thread before each forward, with the forward's items."""
        token = self.config.poison_token
        if token >= 0 and any(token in it.request.prompt_token_ids for it in items):
            raise RuntimeError(f"injected forward failure: a prompt in this batch holds token {token}")

    def _stall(self) -> None:
        """Block while `stall_engine_s` lasts; re-read, so setting it to 0 ends the stall."""
        until = time.monotonic() + self.config.stall_engine_s
        while self.config.stall_engine_s > 0 and time.monotonic() < until:
            time.sleep(0.05)

    def _fail_step(self, engine: LLMEngine) -> None:
        running = list(engine.scheduler.running)
        if self.config.fail_culprit == "longest" and running:
            culprit = max(running, key=lambda r: len(r.prompt_token_ids) + len(r.output_token_ids))
            from engine.llm_engine import RequestFault  # loaded already wherever a step runs
            raise RequestFault(culprit.request_id, f"injected step failure: {culprit.request_id} ran out of memory")
        raise RuntimeError("injected step failure")

    def maybe_kill(self, point: str) -> None:
        if self.config.kill_at == point and self._hit(self.config.kill_rate):
            log.error("fault injection: %s exits at %s", self.worker, point)
            os._exit(17)
