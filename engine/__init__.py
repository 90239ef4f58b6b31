"""The model runner both workers share: paged KV cache, scheduler, sampler, detokenizer.

`LLMEngine` is the entry point: add requests, call `step()` until they finish. The prefill
worker runs it with `prefill_only` requests; the decode worker admits requests whose KV
arrived from a prefill worker with `add_prefilled`.
"""

from engine.config import EngineConfig
from engine.request import InvalidRequest, Request, RequestOutput, SamplingParams

__all__ = ["EngineConfig", "InvalidRequest", "LLMEngine", "Request", "RequestOutput", "SamplingParams"]


def __getattr__(name: str):
    # LLMEngine pulls in transformers; importing it lazily keeps `pdserve plan` and the CLI fast
    if name == "LLMEngine":
        from engine.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
