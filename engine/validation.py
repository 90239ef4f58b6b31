"""Request validation shared by the engine and the router (which has no model loaded).

Every refusal is an `InvalidRequest` whose message is meant for the person who sent it.
"""

from __future__ import annotations

from engine.request import InvalidRequest, SamplingParams


class RequestValidator:
    def __init__(self, tokenizer, vocab_size: int, max_model_len: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len

    def prompt_ids(self, prompt: str | None, prompt_token_ids: list[int] | None) -> list[int]:
        """The prompt as token ids: exactly one of `prompt` / `prompt_token_ids`, non-empty, in vocab."""
        if prompt and prompt_token_ids:
            raise InvalidRequest("give either a prompt or prompt_token_ids, not both")
        ids = list(prompt_token_ids) if prompt_token_ids else self.tokenizer.encode(prompt or "", add_special_tokens=False)
        if not ids:
            raise InvalidRequest("the prompt is empty: give a non-empty prompt or prompt_token_ids")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequest(f"prompt_token_ids has ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")
        return ids

    def check(self, num_prompt_tokens: int, sampling: SamplingParams, pool_blocks: int | None = None,
              block_size: int = 16) -> None:
        """Sampling values in range, and prompt + max_tokens fits the context (and a whole KV pool)."""
        sampling.validate()
        total = num_prompt_tokens + sampling.max_tokens
        if total > self.max_model_len:
            raise InvalidRequest(f"prompt ({num_prompt_tokens} tokens) + max_tokens ({sampling.max_tokens}) = "
                                 f"{total} exceeds the model's context of {self.max_model_len} tokens")
        blocks = -(-total // block_size)
        if pool_blocks is not None and blocks > pool_blocks:
            raise InvalidRequest(f"the request needs {blocks} KV blocks but the largest worker KV pool has "
                                 f"{pool_blocks}; lower max_tokens or the prompt length")
