"""`pdserve chat`: an interactive terminal chat with a running router.

Each turn sends the whole conversation as `messages` (the server renders it with the
checkpoint's chat template) and streams the reply as it is generated. `/exit` or Ctrl-D
quits; Ctrl-C stops the reply being written. A failed turn prints the RPC's status and is
left out of the conversation, so the next question starts from the last good answer.
"""

from __future__ import annotations

import sys
from typing import TextIO

from client import grpc_client as client
from client.credentials import Target

EXIT = "/exit"
PROMPT = ">>> "


def run(address: Target | str, sampling: dict, system: str | None = None, stdin: TextIO | None = None,
        stdout: TextIO | None = None, stderr: TextIO | None = None) -> int:
    """Chat until /exit or end of input; returns the exit status (1: the router is unreachable)."""
    stdin, stdout, stderr = stdin or sys.stdin, stdout or sys.stdout, stderr or sys.stderr
    client.check_reachable(address)
    interactive = stdin.isatty()
    if interactive:
        import readline  # noqa: F401  (line editing and history for input())

        print(f"Chatting with {address}; {EXIT} or Ctrl-D quits.", file=stderr)
    messages = [{"role": "system", "content": system}] if system else []
    while (line := _read(stdin, interactive)) is not None:
        if line.strip() == EXIT:
            break
        if not line.strip():
            continue
        turn = [*messages, {"role": "user", "content": line}]
        reply = _reply(address, turn, sampling, stdout, stderr)
        if reply is not None:
            messages = [*turn, {"role": "assistant", "content": reply}]
    return 0


def _read(stdin: TextIO, interactive: bool) -> str | None:
    """The next line the user typed; None at end of input."""
    if interactive:
        try:
            return input(PROMPT)
        except EOFError:
            print()
            return None
    line = stdin.readline()
    return line.rstrip("\n") if line else None


def _reply(address: Target | str, messages: list[dict], sampling: dict, stdout: TextIO, stderr: TextIO) -> str | None:
    """Stream one reply; its text, or None when the RPC failed or the user interrupted it."""
    parts: list[str] = []
    finish = ""
    try:
        for msg in client.generate(address, messages=messages, **sampling):
            stdout.write(msg.text)
            stdout.flush()
            parts.append(msg.text)
            finish = msg.finish_reason or finish
    except client.RouterError as e:
        print(file=stdout, flush=True)
        print(f"pdserve: {e}", file=stderr, flush=True)
        return None
    except KeyboardInterrupt:
        print(file=stdout, flush=True)
        print("pdserve: reply interrupted", file=stderr, flush=True)
        return None
    print(file=stdout, flush=True)
    if finish == "length":
        print("pdserve: the reply was cut at --max-tokens", file=stderr, flush=True)
    return "".join(parts)
