"""The hostile clients of `python -m stress.hostile`, each a loop until a deadline that
counts what it got (a status, or how the connection ended):

- bodies: maximal chat bodies (every message a chat may have, all the text it may hold), sent
  again as soon as each is answered (issue 23);
- slots: a request whose reply comes before its body (GET /health with a Content-Length of a
  gigabyte), then one byte of body and silence, to hold a connection slot (issue 46, finding 1);
- memory: maximal completion bodies of token ids (4 x router.max_prompt_bytes of JSON: about a
  million ids), as many at once as there are clients (finding 2);
- nonreading: a long streamed completion whose client reads nothing of it (finding 4).

Against a door on loopback the attackers come from addresses of their own, ATTACKERS_PER_ADDRESS
to each of 127.0.1.x (under router.max_connections_per_address: many hosts, each within its share,
the attack the global limits must hold), apart from the good client's 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import collections
import json
import socket
import time

import httpx2

from protocol.limits import MAX_CHAT_MESSAGES

ATTACKS = ("bodies", "slots", "memory", "nonreading")
ATTACKERS_PER_ADDRESS = 100


def source(host: str, i: int) -> str | None:
    """Attacker `i`'s own address when the door is on loopback (127.0.1.1, ...), else the default."""
    if not host.startswith("127."):
        return None
    n = i // ATTACKERS_PER_ADDRESS
    return f"127.0.{1 + n // 254}.{1 + n % 254}"


def chat_body(max_prompt_bytes: int) -> bytes:
    """The largest chat the router accepts to look at: every message it allows, all the text it allows."""
    per_message = max_prompt_bytes // MAX_CHAT_MESSAGES
    messages = [{"role": ("user", "assistant")[i % 2], "content": "lorem ipsum " * (per_message // 12)}
                for i in range(MAX_CHAT_MESSAGES - 1)] + [{"role": "user", "content": "go"}]
    return json.dumps({"messages": messages, "max_tokens": 1}).encode()


def ids_body(max_prompt_bytes: int) -> bytes:
    """The largest completion body the door reads: token ids as JSON text, just under its limit."""
    count = (4 * max_prompt_bytes) // 5  # "1234," is 5 bytes
    return b'{"max_tokens": 1, "prompt": [' + b",".join([b"1234"] * count) + b"]}"


async def _bodies(url: str, body: bytes, until: float, out: collections.Counter, local: str | None) -> None:
    async with httpx2.AsyncClient(timeout=120, transport=httpx2.AsyncHTTPTransport(local_address=local)) as http:
        while time.monotonic() < until:
            try:
                reply = await http.post(url, content=body, headers={"content-type": "application/json"})
                out[str(reply.status_code)] += 1
            except httpx2.TransportError as e:
                out[type(e).__name__] += 1


async def _slot(host: str, port: int, until: float, out: collections.Counter, local: str | None) -> None:
    while time.monotonic() < until:
        try:
            reader, writer = await asyncio.open_connection(host, port, local_addr=(local, 0) if local else None)
        except OSError as e:
            out[type(e).__name__] += 1
            await asyncio.sleep(0.1)
            continue
        try:
            writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 999999999\r\n\r\n")
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"x")
            while await asyncio.wait_for(reader.read(65536), max(until - time.monotonic(), 0.01)):
                pass
            out["closed by the server"] += 1
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError) as e:
            out["held to the end" if isinstance(e, TimeoutError) else type(e).__name__] += 1
        finally:
            writer.close()


async def _nonreading(host: str, port: int, tokens: int, until: float, out: collections.Counter,
                      local: str | None) -> None:
    body = json.dumps({"prompt": [5, 6, 7], "max_tokens": tokens, "stream": True, "ignore_eos": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    while time.monotonic() < until:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        if local:
            sock.bind((local, 0))
        loop = asyncio.get_running_loop()
        try:
            await loop.sock_connect(sock, (host, port))
            await loop.sock_sendall(sock, head + body)
            out[(await loop.sock_recv(sock, 12)).decode("latin-1")] += 1
            await asyncio.sleep(max(until - time.monotonic(), 0))  # reads nothing more, ever
        except OSError as e:
            out[type(e).__name__] += 1
            await asyncio.sleep(0.1)
        finally:
            sock.close()


async def run(attack: str, url: str, max_prompt_bytes: int, clients: int, seconds: float,
              stream_tokens: int) -> dict:
    """`clients` of `attack` against the door at `url` (".../v1") for `seconds`; what they got.
    `stream_tokens`: the length of each stream nobody reads (nonreading)."""
    out: collections.Counter = collections.Counter()
    until = time.monotonic() + seconds
    host, port = url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
    if attack == "bodies":
        body = chat_body(max_prompt_bytes)
        jobs = [_bodies(f"{url}/chat/completions", body, until, out, source(host, i)) for i in range(clients)]
    elif attack == "memory":
        body = ids_body(max_prompt_bytes)
        jobs = [_bodies(f"{url}/completions", body, until, out, source(host, i)) for i in range(clients)]
    elif attack == "slots":
        jobs = [_slot(host, int(port), until, out, source(host, i)) for i in range(clients)]
    else:
        jobs = [_nonreading(host, int(port), stream_tokens, until, out, source(host, i)) for i in range(clients)]
    await asyncio.gather(*jobs)
    return dict(out)
