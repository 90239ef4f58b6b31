"""Hard limits on what one request may ask for, shared by the engine and the router.

They bound the work a single request can cause before any model work happens (prompt bytes
are counted before tokenizing) and keep stop matching and ids cheap to carry and log.
"""

from __future__ import annotations

MAX_REQUEST_ID_CHARS = 128
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 100
MAX_STOP_TOKEN_IDS = 64
MAX_CACHE_SALT_CHARS = 256
MAX_CHAT_MESSAGES = 1024  # rendering a chat costs per message, however short
DEFAULT_MAX_PROMPT_BYTES = 1 << 20
CHAT_MAX_TOKENS = 256  # a chat that sets no max_tokens: the rest of the context, at most this many
FLOAT32_SMALLEST_NORMAL = 1.1754944e-38  # below it (and above 0) a float32 is denormal
