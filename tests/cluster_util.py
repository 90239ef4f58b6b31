"""Helpers for end-to-end tests: configs on free ports, a blocking gRPC client, fault injection
on a running cluster, references."""

from __future__ import annotations

import contextlib
import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import ray

from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from router.config.loader import parse_config
from router.config.schema import ClusterConfig
from worker_runtime.faults import FaultConfig


def free_port() -> int:
    """A port nothing listens at (for a client that must find nobody there); a server binds 0."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cluster_config(model_path: str, **overrides) -> ClusterConfig:
    raw = {
        # float32, as the references (transformers' float32 `generate`): `auto` is bfloat16 on a CPU
        # that computes it natively (AVX512-BF16 or AMX), and bfloat16 greedy text is not float32's
        "model": {"path": model_path, "dtype": "float32"},
        "router": {"port": 0, "metrics_port": 0, "shutdown_grace_s": 5},  # 0: the bound port is read back
        # one torch thread per worker, as before `torch_threads: auto`: many workers share 2 cores in
        # the suite; glibc's malloc, so a worker needs no runtime_env (LD_PRELOAD), whose fresh
        # process cost a worker start here ~0.6 s more (5 starts each, alternating). The session's
        # default clusters (conftest `served`, `served_colocated`) run the defaults: auto, auto
        "prefill": {"replicas": 1, "num_cpus": 0.5, "torch_threads": 1, "malloc": "system"},
        "decode": {"replicas": 1, "num_cpus": 0.5, "torch_threads": 1, "malloc": "system"},
        "kv_cache": {"block_size": 16, "num_blocks": 256},
        "kv_transfer": {"timeout_s": 10},
    }
    for key, value in overrides.items():
        if isinstance(value, dict):
            raw.setdefault(key, {}).update(value)
        else:
            raw[key] = value
    return parse_config(raw)


def kv_bytes(model_dir: str, num_tokens: int, block_size: int) -> int:
    """What pushing the KV of `num_tokens` costs, from the checkpoint's config.json alone:
    whole blocks x layers x K,V x block_size x kv heads x head_dim x bytes per value."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    dtype_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}[cfg.get("torch_dtype") or cfg["dtype"]]
    blocks = -(-num_tokens // block_size)
    return blocks * cfg["num_hidden_layers"] * 2 * block_size * cfg["num_key_value_heads"] * head_dim * dtype_bytes


def set_faults(cluster, **knobs) -> None:
    """Fault injection (worker_runtime/faults.py) on every worker of a running cluster, and on
    the workers it starts later; no knobs: all off."""
    cluster.call(cluster.router.pools.set_faults(FaultConfig(**knobs)))


@contextlib.contextmanager
def faults(cluster, **knobs):
    """`set_faults` for the block; all off again after it, also when it fails."""
    set_faults(cluster, **knobs)
    try:
        yield
    finally:
        set_faults(cluster)


def set_worker_faults(workers, **knobs) -> None:
    """Fault injection on these workers (WorkerViews) only; their replacements start without."""
    ray.get([w.actor.set_faults.remote(FaultConfig(**knobs)) for w in workers], timeout=30)


def hold_engine(worker, seconds: float, release: Path | None = None) -> None:
    """Occupy the engine loop thread of `worker` (a WorkerView) for `seconds`: every call that
    needs the engine (reserve, add, abort, stats) waits behind it, as behind a long step. Returns
    once the hold is queued; it begins at once on an idle engine. With `release` (a file that
    exists), the hold ends as soon as the test removes it: an end set by an event, not a guess of
    how long the event takes on a loaded host (the worker runs on this host, so it sees the file)."""
    def hold(engine) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end and (release is None or release.exists()):
            time.sleep(0.01)
    ray.get(worker.actor.__ray_call__.remote(lambda actor: actor.core.loop.call(hold) and None), timeout=30)


@contextlib.contextmanager
def held_engines(workers, seconds: float, directory: Path):
    """`hold_engine` on each of `workers` for at most `seconds`, each hold ended when the block
    ends (its release file, in `directory`, removed), the block's failures included."""
    release = directory / "held-engines"
    release.touch()
    try:
        for w in workers:
            hold_engine(w, seconds, release)
        yield
    finally:
        release.unlink(missing_ok=True)


def wait_until(cond, timeout: float, what: str, every: float = 0.02) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(every)


def whole(cluster) -> bool:
    """No request in flight, every pool at its size with every worker ready, no KV block held."""
    pools = cluster.router.pools
    if cluster.router.lives or any(len(pools.ready(p)) != t or len(pools.live(p)) != t
                                   for p, t in pools.targets.items()):
        return False
    counts = ray.get([w.actor.check.remote() for w in pools.all()], timeout=30)
    return all(c["used"] == 0 and c["free"] == c["total"] for c in counts)


class Client:
    def __init__(self, address: str):
        self.channel = grpc.insecure_channel(address)
        self.gen = pb_grpc.GenerationStub(self.channel)
        self.admin = pb_grpc.AdminStub(self.channel)

    def stream(self, prompt_ids: list[int] | None = None, prompt: str = "", **sampling):
        req = pb.GenerateRequest(prompt=prompt, prompt_token_ids=prompt_ids or [],
                                 sampling=pb.SamplingParams(**sampling))
        return self.gen.Generate(req, timeout=120)

    def tokens(self, prompt_ids: list[int], **sampling) -> tuple[list[int], pb.GenerateResponse]:
        out, last = [], None
        for msg in self.stream(prompt_ids, **sampling):
            out.extend(msg.token_ids)
            last = msg
        return out, last

    def many(self, prompts: list[list[int]], **sampling) -> list[list[int]]:
        with ThreadPoolExecutor(len(prompts)) as pool:
            return [r[0] for r in pool.map(lambda p: self.tokens(p, **sampling), prompts)]

    def status(self) -> pb.StatusResponse:
        return self.admin.Status(pb.StatusRequest(), timeout=30)

    def close(self) -> None:
        self.channel.close()
