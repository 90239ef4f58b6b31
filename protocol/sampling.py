"""How a request wants its tokens chosen: `SamplingParams`, validated into `InvalidRequest`.

`cache_salt` is no sampling choice but rides along because every hop that must honour it (the
router's prefix index, a decode reservation, each engine's block hashing, a migration) already
carries the sampling params: requests share prefix-cache blocks only under equal salts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from protocol.errors import InvalidRequest
from protocol.limits import (
    FLOAT32_SMALLEST_NORMAL,
    MAX_CACHE_SALT_CHARS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    cache_salt: str = field(default="", repr=False)  # "" = the shared cache (protocol/block_hash.py)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        if self.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be at least 1, got {self.max_tokens}")
        _check_normal_number("temperature", self.temperature)
        if self.temperature < 0:
            raise InvalidRequest(f"temperature must be >= 0, got {self.temperature}")
        _check_normal_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequest(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        self._validate_stops()
        if len(self.cache_salt) > MAX_CACHE_SALT_CHARS:
            raise InvalidRequest(f"cache_salt is {len(self.cache_salt)} characters; at most {MAX_CACHE_SALT_CHARS} "
                                 "are allowed")

    def _validate_stops(self) -> None:
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequest(f"{len(self.stop)} stop strings given; at most {MAX_STOP_STRINGS} are allowed")
        if any(s == "" for s in self.stop):
            raise InvalidRequest("stop strings must not be empty")
        longest = max((len(s) for s in self.stop), default=0)
        if longest > MAX_STOP_STRING_CHARS:
            raise InvalidRequest(f"a stop string is {longest} characters; at most {MAX_STOP_STRING_CHARS} are allowed")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequest(f"{len(self.stop_token_ids)} stop_token_ids given; at most "
                                 f"{MAX_STOP_TOKEN_IDS} are allowed")


def _check_normal_number(name: str, value: float) -> None:
    """Refuse nan, +-inf and float32 denormals: the sampler cannot divide by them safely."""
    if not math.isfinite(value):
        raise InvalidRequest(f"{name} must be a finite number, got {value}")
    if 0 < abs(value) < FLOAT32_SMALLEST_NORMAL:
        raise InvalidRequest(f"{name} must be 0 or at least {FLOAT32_SMALLEST_NORMAL} in size (smaller numbers "
                             f"are denormal), got {value}")
