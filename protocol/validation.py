"""Request validation shared by the engine and the router (which has no model loaded).

Every refusal is an `InvalidRequest` whose message is meant for the person who sent it.
Cheap size checks run before any work that grows with the input (tokenizing, vocab scans).
"""

from __future__ import annotations

from jinja2 import TemplateError, TemplateSyntaxError

from protocol.errors import InvalidRequest
from protocol.limits import DEFAULT_MAX_PROMPT_BYTES, MAX_CHAT_MESSAGES, MAX_REQUEST_ID_CHARS
from protocol.sampling import SamplingParams

CHAT_ROLES = ("system", "user", "assistant")
PROBE_CHARS_PER_TOKEN = 8  # text is rarely over this many characters a token


def check_message_count(count: int) -> None:
    """At most MAX_CHAT_MESSAGES: checked before a chat is even copied, let alone rendered."""
    if count > MAX_CHAT_MESSAGES:
        raise InvalidRequest(f"{count} messages given; at most {MAX_CHAT_MESSAGES} are allowed")


def validate_request_id(request_id: str) -> None:
    """At most MAX_REQUEST_ID_CHARS printable ASCII characters without whitespace; empty is allowed."""
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequest(f"request_id is {len(request_id)} characters; at most {MAX_REQUEST_ID_CHARS} "
                             "are allowed")
    for i, ch in enumerate(request_id):
        if not "\x21" <= ch <= "\x7e":
            raise InvalidRequest("request_id may contain only printable ASCII characters without spaces "
                                 f"(found {ch!r} at {i})")


class RequestValidator:
    def __init__(self, tokenizer, vocab_size: int, max_model_len: int,
                 max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_prompt_bytes = max_prompt_bytes

    def prompt_ids(self, prompt: str | None, prompt_token_ids: list[int] | None,
                   messages: list[dict] | None = None, add_special_tokens: bool | None = None) -> list[int]:
        """The prompt as token ids: exactly one of `prompt` / `prompt_token_ids` / `messages` (a chat,
        rendered with the checkpoint's chat template), non-empty, in vocab. `add_special_tokens`
        (None: the default, as transformers and vLLM have it): a text prompt gets the tokenizer's
        special tokens (its BOS); a rendered chat does not, since its template writes them; token
        ids are taken as given."""
        if messages:
            if prompt or prompt_token_ids:
                raise InvalidRequest("give either messages or a prompt / prompt_token_ids, not both")
            return self.chat_ids(messages, bool(add_special_tokens))
        if prompt and prompt_token_ids:
            raise InvalidRequest("give either a prompt or prompt_token_ids, not both")
        if prompt_token_ids:
            self.check_prompt_length(len(prompt_token_ids))
            ids = list(prompt_token_ids)
            self.check_token_ids("prompt_token_ids", ids)
            return ids
        ids = self._encode(prompt, add_special_tokens is not False) if prompt else []
        if not ids:
            raise InvalidRequest("the prompt is empty: give a non-empty prompt or prompt_token_ids")
        return ids

    def check_prompt_length(self, num_token_ids: int) -> None:
        """At most the context: checked on a count before the ids are even copied."""
        if num_token_ids > self.max_model_len:
            raise InvalidRequest(f"prompt_token_ids has {num_token_ids} tokens; the model's context "
                                 f"is {self.max_model_len} tokens")

    def chat_ids(self, messages: list[dict], add_special_tokens: bool = False) -> list[int]:
        """A chat ([{"role", "content"}, ...]) rendered with the chat template, ready for the reply."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequest("this model has no chat template: send a prompt instead of messages")
        check_message_count(len(messages))
        for i, m in enumerate(messages):
            if m.get("role") not in CHAT_ROLES:
                raise InvalidRequest(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {m.get('role')!r}")
            if not isinstance(m.get("content"), str):
                raise InvalidRequest(f"messages[{i}].content must be text")
        size = sum(len(m["content"].encode("utf-8", "surrogatepass")) for m in messages)
        if size > self.max_prompt_bytes:
            raise InvalidRequest(f"the messages are {size} bytes; at most {self.max_prompt_bytes} are allowed")
        return self._encode(self._render(messages), add_special_tokens)

    def _render(self, messages: list[dict]) -> str:
        """The chat template's text for `messages`; a template that refuses them (its
        raise_exception, e.g. roles that do not alternate) is InvalidRequest with a sentence of ours."""
        try:
            return self.tokenizer.apply_chat_template([{"role": m["role"], "content": m["content"]} for m in messages],
                                                      add_generation_prompt=True, tokenize=False)
        except TemplateSyntaxError:
            raise  # the checkpoint's template is broken: not the request's fault
        except TemplateError:
            raise InvalidRequest("this model's chat template refused these messages (templates often need user "
                                 "and assistant messages to alternate, after an optional system message)") from None

    def _encode(self, prompt: str, add_special_tokens: bool) -> list[int]:
        try:
            size = len(prompt.encode("utf-8"))
        except UnicodeEncodeError as e:
            raise InvalidRequest(f"the prompt is not valid Unicode text (a lone surrogate at {e.start})") from None
        if size > self.max_prompt_bytes:
            raise InvalidRequest(f"the prompt is {size} bytes; at most {self.max_prompt_bytes} are allowed")
        self._refuse_early_if_too_long(prompt)
        return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)

    def _refuse_early_if_too_long(self, prompt: str) -> None:
        """A long text is first tokenized only up to a space near PROBE_CHARS_PER_TOKEN x the
        context: if that head alone is over the context, the prompt is refused without the rest
        being tokenized (a maximal hostile prompt then costs a small part of its full tokenizing).
        A head cut before a space tokenizes to the leading tokens of the whole text."""
        probe = PROBE_CHARS_PER_TOKEN * self.max_model_len
        if len(prompt) <= probe:
            return
        cut = prompt.rfind(" ", 0, probe)
        head = len(self.tokenizer.encode(prompt[:cut if cut > 0 else probe], add_special_tokens=False))
        if head > self.max_model_len:
            raise InvalidRequest(f"the prompt is over {self.max_model_len} tokens, the model's context (its first "
                                 f"{cut if cut > 0 else probe} characters alone are {head} tokens)")

    def check_token_ids(self, name: str, ids: list[int] | tuple[int, ...]) -> None:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequest(f"{name} has ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")

    def check(self, num_prompt_tokens: int, sampling: SamplingParams, pool_blocks: int | None = None,
              block_size: int = 16, pool_tokens: int | None = None) -> None:
        """Sampling values in range, prompt + max_tokens fits the context, and `pool_tokens` (by
        default also prompt + max_tokens: what a decoding worker holds at the end) fit a whole KV
        pool of `pool_blocks`. A prefill-only worker holds only the context and one more token."""
        sampling.validate()
        self.check_token_ids("stop_token_ids", sampling.stop_token_ids)
        total = num_prompt_tokens + sampling.max_tokens
        if total > self.max_model_len:
            raise InvalidRequest(f"prompt ({num_prompt_tokens} tokens) + max_tokens ({sampling.max_tokens}) = "
                                 f"{total} exceeds the model's context of {self.max_model_len} tokens")
        blocks = -(-(total if pool_tokens is None else pool_tokens) // block_size)
        if pool_blocks is not None and blocks > pool_blocks:
            raise InvalidRequest(f"the request needs {blocks} KV blocks but the largest worker KV pool has "
                                 f"{pool_blocks}; lower max_tokens or the prompt length")

    def check_resumed(self, output_token_ids: list[int], sampling: SamplingParams) -> None:
        """Outputs a resumed request already produced: in vocab, and max_tokens leaves one more to make."""
        self.check_token_ids("output_token_ids", output_token_ids)
        if len(output_token_ids) >= sampling.max_tokens:
            raise InvalidRequest(f"the request already has {len(output_token_ids)} output tokens; max_tokens "
                                 f"({sampling.max_tokens}) leaves none to generate")
