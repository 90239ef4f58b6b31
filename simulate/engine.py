"""A worker's engine with no model, stepped on the simulation's event loop.

`SimRunner` stands in for `ModelRunner`: it sizes the pool like the emulated device (no tensor
is allocated) and samples each row's token from a deterministic stream of the request's prompt
and position, so two runs with one seed produce the same tokens. `SimEngineLoop` has
`EngineLoop`'s interface (`call`, `beat`, `stop`, `engine`) but runs as an asyncio task: calls
queued with `call` run between steps, as on the engine thread; each step's code runs at once and
the loop then sleeps the cost model's time for the step's shape (virtual time: nothing waits on
the wall clock). Inside the step the clock already reads the step's end (protocol.clock.ahead),
so the engine's step records and its prompts' compute times are the modelled ones. `SimCore` is
`WorkerCore` over that loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections import deque
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.request import ScheduledItem
from protocol import clock
from protocol.messages import EngineBeat
from protocol.outputs import RequestOutput
from sizing.cost_model import CostModel
from worker_runtime.core import WorkerCore

log = logging.getLogger(__name__)
FIRST_TOKEN = 1000  # streamed ids stay clear of the low ids tokenizers keep for special tokens


class SimRunner:
    """`ModelRunner`'s interface with no model: `num_blocks` from the config (the emulated device's
    pool), blocks of `block_bytes` (the emulated model's KV per block), and tokens from a stream."""

    argmax = None
    kernel_isa = "simulated"  # WorkerInfo.kernels: no CPU kernel runs

    def __init__(self, config: EngineConfig, vocab_size: int, max_positions: int, block_bytes: int):
        assert config.num_blocks, "a simulated worker's pool size comes from the config (the emulated device)"
        self.num_blocks = config.num_blocks
        self.block_bytes = block_bytes
        self.hf_config = SimpleNamespace(vocab_size=vocab_size, max_position_embeddings=max_positions)
        self._span = vocab_size - FIRST_TOKEN

    def describe(self) -> str:
        return f"simulated (no model), {self.num_blocks} KV blocks"

    def execute(self, items: list[ScheduledItem], greedy: bool = True) -> torch.Tensor:
        """One token per sampling row: [rows] (an engine reads a 1-D result as the step's tokens)."""
        return torch.tensor([self.token(it.request.prompt_token_ids, it.request.num_tokens)
                             for it in items if it.samples], dtype=torch.long)

    def token(self, prompt: list[int], position: int) -> int:
        """The token at `position` of the request with this prompt: the same in every run."""
        mix = (prompt[0] * 2654435761 + len(prompt) * 40503 + prompt[-1] * 97 + position * 2246822519) % (1 << 32)
        return FIRST_TOKEN + mix % self._span


class SimEngineLoop:
    def __init__(self, engine: LLMEngine, cost: CostModel, on_outputs: Callable[[list[RequestOutput]], None],
                 name: str, after_step: Callable[[LLMEngine], None] | None = None):
        self.engine = engine
        self.name = name
        self._cost = cost
        self._on_outputs = on_outputs
        self._after_step = after_step
        self._inbox: deque[tuple[Callable[[LLMEngine], Any], asyncio.Future]] = deque()
        self._wake = asyncio.Event()
        self._ahead = None  # the clock token of the step being run
        self.stepping_since: float | None = None
        self.beat_at = clock.now()
        self.steps = 0
        self.busy_s = 0.0  # modelled seconds of steps run
        self.failed_steps_in_a_row = 0
        # (worker, step, has a prompt) -> a factor on the modelled time: a real host's spread (simulate/serving.py)
        self.spread: Callable[[str, int, bool], float] | None = None
        engine.pace = self._pace
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"{name}-loop")

    def call(self, fn: Callable[[LLMEngine], Any]) -> asyncio.Future:
        """`fn(engine)` between two steps; its result (or error) in the future."""
        fut = asyncio.get_running_loop().create_future()
        if self._task.done():
            fut.set_exception(RuntimeError("the engine loop has stopped"))
            return fut
        self._inbox.append((fn, fut))
        self._wake.set()
        return fut

    def set_hooks(self, name: str, on_outputs: Callable[[list[RequestOutput]], None],
                  before_step: Callable[[], None] | None, after_step: Callable[[LLMEngine], None] | None) -> None:
        """EngineLoop.set_hooks (no fault hook runs in a simulation)."""
        self.name, self._on_outputs, self._after_step = name, on_outputs, after_step

    def stop(self) -> None:
        self._task.cancel()

    def beat(self) -> EngineBeat:
        """Silent only while a step runs (for its modelled time so far), as an engine thread is."""
        silent = 0.0 if self.stepping_since is None else clock.now() - self.stepping_since
        return EngineBeat(self.name, silent, self.steps, self.failed_steps_in_a_row)

    async def _run(self) -> None:
        while True:
            while self._inbox:
                fn, fut = self._inbox.popleft()
                _apply(self.engine, fn, fut)
            if not self.engine.has_unfinished():
                self._wake.clear()
                await self._wake.wait()
                continue
            began = clock.now()
            step_s, outputs = self._step()
            if step_s > 0:
                self.stepping_since = began
                await asyncio.sleep(step_s)
                self.stepping_since = None
                self.steps += 1
                self.busy_s += step_s
                if self._after_step is not None:  # a prefill worker's KV pieces leave at the step's end
                    self._after_step(self.engine)
            if outputs:
                self._on_outputs(outputs)
            elif step_s <= 0:  # nothing could run (waiting for blocks): only a call can change that
                self._wake.clear()
                if not self._inbox:
                    await self._wake.wait()

    def _step(self) -> tuple[float, list[RequestOutput]]:
        """Runs one step's code: its modelled seconds (0 when nothing ran) and its outputs."""
        try:
            outputs = self.engine.step()
            step_s = self._step_time()
        finally:
            if self._ahead is not None:
                clock.behind(self._ahead)
                self._ahead = None
        return step_s, outputs

    def _pace(self) -> None:
        """`engine.pace`, inside the step once its tokens are sampled: the step ends now."""
        self._ahead = clock.ahead(self._step_time())

    def _step_time(self) -> float:
        """The cost model's time for the step just run, times the host's spread where one is set."""
        step = self.engine.last_step
        step_s = self._cost.step_s(step)
        if self.spread is not None and step_s > 0:
            step_s *= self.spread(self.name, self.steps, any(not it.is_decode for it in step))
        return step_s


def _apply(engine: LLMEngine, fn: Callable[[LLMEngine], Any], fut: asyncio.Future) -> None:
    try:
        result = fn(engine)
    except Exception as e:  # handed to the caller, who turns it into a status
        if not fut.cancelled():
            fut.set_exception(e)
        return
    if not fut.cancelled():
        fut.set_result(result)


class SimCore(WorkerCore):
    """`WorkerCore` (info, stats, telemetry, check) over a `SimEngineLoop`; no thread, no device."""

    def __init__(self, name: str, pool: str, config: EngineConfig, runner: SimRunner, cost: CostModel,
                 on_outputs: Callable[[list[RequestOutput]], None],
                 after_step: Callable[[LLMEngine], None] | None = None):
        self.name, self.pool, self.cpu, self.node_ip = name, pool, None, "simulated"
        self.pacer = None
        config = dataclasses.replace(config, torch_threads=None)
        self.loop = SimEngineLoop(LLMEngine(config, runner), cost, on_outputs, name, after_step)
        self.engine = self.loop.engine
        self.served = 0
        self.cache_seq = 0
        self.aio = asyncio.get_running_loop()
