"""Emulated devices, worker side: every engine step padded to the time the cost model gives for
its shape on the emulated device (sizing/cost_model.py) x time_scale, and a worker's start-up to
the emulated weights load; counters of how faithful that was (protocol.telemetry.EmulationStats).

The engine calls `pace(engine, began)` (through the loop, `LLMEngine.pace`) inside each step, once
its tokens are sampled and before the step is recorded: it sleeps until `began + modelled x
time_scale`, so the step's outputs (and the KV it filled) leave when the emulated device would
have finished it, and the step's record and its prompts' compute time are the emulated ones. A step whose real work took longer overran: nothing is
slept and it is late by the difference. The engine's logic is untouched: tokens are the real
model's. Only this thread sleeps; calls queued meanwhile run after, as behind a busy device.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import numpy as np

from engine.llm_engine import LLMEngine
from protocol.telemetry import EmulationStats
from sizing.cost_model import Emulation, StepShape

RATIOS_KEPT = 100_000  # steps whose real / modelled ratio the p99 is taken over (the latest)


class Pacer:
    def __init__(self, emulation: Emulation, clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep):
        self.emulation = emulation
        self._clock = clock
        self._sleep = sleep
        self.steps = self.overruns = 0
        self.real_s = self.modelled_s = self.lateness_s = self.max_lateness_s = 0.0
        self._ratios: deque[float] = deque(maxlen=RATIOS_KEPT)

    def pace(self, engine: LLMEngine, began: float) -> None:
        """Loop thread, after a step that began at `began` (clock seconds)."""
        self.pace_step(engine.last_step, began)

    def pace_step(self, step: StepShape, began: float) -> float:
        """Sleep out what is left of the step's modelled time x time_scale; the seconds slept.
        An empty step (nothing computed) is not paced."""
        modelled = self.emulation.cost.step_s(step)
        if modelled <= 0:
            return 0.0
        target = modelled * self.emulation.time_scale
        real = self._clock() - began
        self.steps += 1
        self.real_s += real
        self.modelled_s += modelled
        self._ratios.append(real / modelled)
        if real > target:
            self.overruns += 1
            self.lateness_s += real - target
            self.max_lateness_s = max(self.max_lateness_s, real - target)
            return 0.0
        self._sleep(target - real)
        return target - real

    def wait_startup(self, began: float) -> float:
        """Sleep until the emulated weights would have loaded (x time_scale) since `began`, the
        worker's start; the seconds slept (0 when the real load took longer)."""
        left = self.emulation.startup_s * self.emulation.time_scale - (self._clock() - began)
        if left > 0:
            self._sleep(left)
        return max(left, 0.0)

    def stats(self) -> EmulationStats:
        p99 = float(np.percentile(np.fromiter(self._ratios, float), 99)) if self._ratios else 0.0
        return EmulationStats(self.emulation.time_scale, self.steps, self.overruns, self.real_s, self.modelled_s,
                              self.lateness_s, self.max_lateness_s, p99, self.emulation.startup_s)
