"""The model runner both workers share: paged KV cache, scheduler, sampler, detokenizer.

`LLMEngine` is the entry point: add requests, call `step()` until they finish. The prefill
worker runs it with `prefill_only` requests; the decode worker admits requests whose KV
arrived from a prefill worker with `add_prefilled`.
"""

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.request import InvalidRequest, Request, RequestOutput, SamplingParams

__all__ = ["EngineConfig", "InvalidRequest", "LLMEngine", "Request", "RequestOutput", "SamplingParams"]
