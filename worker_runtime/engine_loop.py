"""Runs an `LLMEngine` on one background thread; other threads talk to it through `call`.

The loop builds its engine on that thread too (`make_engine`), so every torch op of the engine
(load, warm-up, steps) starts from one thread. GNU OpenMP gives each thread that starts a
parallel region a team of its own, and once a process's OpenMP threads outnumber its cores it
stops letting idle team threads spin between parallel regions: they sleep on a futex after about
a hundred spins and are woken for each op. A worker that loaded its model on the actor's
thread and stepped on this one had two teams, and its steps ran 1.25-1.4x slower than the same
engine stepped where it was built (docs/engine_speed.md, "One OpenMP team per worker").

The engine is not thread-safe, so every touch (add, reserve, abort, ...) is queued with
`call(fn)` and runs on the loop thread between two steps; the caller gets a
`concurrent.futures.Future`. Each step's outputs go to `on_outputs` (on the loop thread).
`before_step`, if given, runs on the loop thread before every step (fault injection hooks in
there); if it raises, that step fails like a failed forward. `pace(engine, began)`, if given,
runs inside every step, once its tokens are sampled and before the step is recorded (an emulated
device's step time, worker_runtime/pacing.py: the engine's step record and its prompts' compute
time are then the emulated step's, which the bench reports). `began`
is when the loop last became free with work waiting: the end of the previous step's pacing while
the loop stays busy, else when work arrived. The host work between two steps (the previous
step's outputs and hooks, the queued calls) is then charged to the next step's modelled time,
which `step_overhead_s` stands for, instead of silently adding to every emulated step.
`after_step`, if given, runs on the loop thread after every step, before `on_outputs` (the
prefill worker streams the KV blocks the step filled from there).

Liveness comes from the thread itself: it stamps `beat_at` each time round its loop (after a
step, after the calls it ran, and every BEAT_S while idle), and `beat()` reads the stamp without
waiting for the thread, so a step stuck in a CUDA or NCCL call shows as silence the router can
see (router/pools/monitor.py) while the actor still answers.

A forward that fails on one request fails that request alone, inside the engine's step (the
engine runs the step again in halves to find it, engine/isolation.py). A step that still fails
fails its requests retryably (the router moves them: the failure may be transient, a CUDA OOM
from one long chunk, or the worker broken), except a culprit the error names (`RequestFault`),
which fails alone and for good. Failed steps in a row are counted for the beat: a worker that keeps failing
is replaced by the router.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from engine.llm_engine import LLMEngine, RequestFault
from protocol.messages import EngineBeat
from protocol.outputs import RequestOutput

log = logging.getLogger(__name__)
BEAT_S = 0.25  # an idle loop stamps its beat this often


class EngineLoop:
    engine: LLMEngine  # built on the loop thread (`_build`)

    def __init__(self, make_engine: Callable[[], LLMEngine], on_outputs: Callable[[list[RequestOutput]], None],
                 name: str = "engine", before_step: Callable[[], None] | None = None,
                 after_step: Callable[[LLMEngine], None] | None = None,
                 pace: Callable[[LLMEngine, float], None] | None = None):
        """Starts the thread and returns once it has built the engine (`make_engine()`, on that
        thread); an error building it is raised here, and the thread is gone."""
        self._on_outputs = on_outputs
        self._before_step = before_step
        self._after_step = after_step
        self._pace = pace
        self._free_since: float | None = None  # the loop's time free with work waiting (see `pace`)
        self._inbox: list[tuple[Callable[[LLMEngine], Any], Future]] = []
        self._wake = threading.Condition()
        self._stopped = False
        self.name = name
        self.beat_at = time.monotonic()  # written by the loop thread only
        self.steps = 0
        self.failed_steps_in_a_row = 0
        built: Future = Future()
        self._thread = threading.Thread(target=self._run, args=(make_engine, built), name=f"{name}-loop", daemon=True)
        self._thread.start()
        built.result()  # raises the build's error; no deadline: the router's worker_start_timeout_s bounds a start

    def _build(self, make_engine: Callable[[], LLMEngine], built: Future) -> bool:
        """Sets `self.engine` (on the loop thread, before anything else reads it); False if it failed."""
        try:
            self.engine = make_engine()
        except BaseException as e:  # handed to the constructor, which raises it
            built.set_exception(e)
            return False
        if self._pace is not None:
            self.engine.pace = self._pace_step
        built.set_result(None)
        return True

    def call(self, fn: Callable[[LLMEngine], Any]) -> Future:
        fut: Future = Future()
        with self._wake:
            if self._stopped:
                fut.set_exception(RuntimeError("the engine loop has stopped"))
                return fut
            self._inbox.append((fn, fut))
            self._wake.notify()
        return fut

    def set_hooks(self, name: str, on_outputs: Callable[[list[RequestOutput]], None],
                  before_step: Callable[[], None] | None, after_step: Callable[[LLMEngine], None] | None) -> None:
        """Another role's callbacks (worker_host/): only while the engine is idle (drained)."""
        self.name, self._on_outputs, self._before_step, self._after_step = name, on_outputs, before_step, after_step

    def stop(self) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify()
        self._thread.join(timeout=10)

    def beat(self) -> EngineBeat:
        """The thread's last sign of life; any thread, never waits for the loop."""
        return EngineBeat(self.name, time.monotonic() - self.beat_at, self.steps, self.failed_steps_in_a_row)

    def _pace_step(self) -> None:
        """`engine.pace`: inside a step the loop runs (a step run by a queued call: from now)."""
        began = self._free_since if self._free_since is not None else time.perf_counter()
        self._pace(self.engine, began)

    def _run(self, make_engine: Callable[[], LLMEngine], built: Future) -> None:
        if not self._build(make_engine, built):
            return
        while True:
            with self._wake:
                while not self._inbox and not self.engine.has_unfinished() and not self._stopped:
                    self._free_since = None
                    self.beat_at = time.monotonic()
                    self._wake.wait(BEAT_S)
                if self._stopped:
                    return
                inbox, self._inbox = self._inbox, []
            if self._free_since is None:
                self._free_since = time.perf_counter()
            for fn, fut in inbox:
                self._apply(fn, fut)
            self.beat_at = time.monotonic()
            if self.engine.has_unfinished():
                outputs = self._step()  # paced inside, when paced (engine.pace)
                self._free_since = time.perf_counter()
                if self._after_step is not None:
                    self._hook(self._after_step)
                self.steps += 1
                self.beat_at = time.monotonic()
                if outputs:
                    self._on_outputs(outputs)

    def _step(self) -> list[RequestOutput]:
        try:
            if self._before_step is not None:
                self._before_step()
            outputs = self.engine.step()
        except Exception as e:  # a failed step must not leave every request hanging
            self.failed_steps_in_a_row += 1
            log.exception("engine step failed (%d in a row); its requests move elsewhere",
                          self.failed_steps_in_a_row)
            return self._fail_step(e)
        self.failed_steps_in_a_row = 0
        return outputs

    def _fail_step(self, error: Exception) -> list[RequestOutput]:
        """Every request the engine holds fails retryably (another worker may well serve it),
        except the culprit `error` names, if it does: that one fails for good."""
        culprit = error.request_id if isinstance(error, RequestFault) else None
        outputs = self.engine.fail_all(f"the engine step failed: {error}")
        for out in outputs:
            out.retryable = out.request_id != culprit
        return outputs

    def _apply(self, fn: Callable[[LLMEngine], Any], fut: Future) -> None:
        try:
            fut.set_result(fn(self.engine))
        except Exception as e:  # handed to the caller, who turns it into a status
            fut.set_exception(e)

    def _hook(self, fn: Callable[[LLMEngine], None]) -> None:
        try:
            fn(self.engine)
        except Exception:  # no caller to hand it to: logged, and the loop goes on
            log.exception("after_step hook failed")
