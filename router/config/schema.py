"""cluster.yaml: one validated schema for the whole cluster.

`load_config(path)` reads YAML into frozen dataclasses and refuses, with one message naming
the key, any unknown key, wrong type or impossible value (`ConfigError`; the CLI exits 2).
Sizes accept "512MiB"-style strings. Relative `model.path` is relative to the file, and so are
the router.tls / router.auth files, read and checked at load (the certificate matches its key,
the tokens are well formed): a bad one is a config error, not a failure once the cluster runs.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from typing import Literal

from checkpoints.gguf import SMOLLM2_OUT_DIR
from engine.config import DEFAULT_MEMORY_FRACTION, EngineConfig
from protocol.limits import DEFAULT_MAX_PROMPT_BYTES
from protocol.sizes import parse_bytes
from router.config.autoscale import AutoscaleSection
from router.config.emulate import EmulateSection, emulated_num_blocks
from worker_runtime.faults import FaultConfig

Policy = Literal["cache_aware", "load", "round_robin"]
POLICIES: tuple[str, ...] = typing.get_args(Policy)  # the placement policies, in the order help lists them
DecodeReservation = Literal["before_prefill", "after_prefill"]  # router.decode_reservation


@dataclass(frozen=True)
class ModelSection:
    path: str = str(SMOLLM2_OUT_DIR)  # where `bash scripts/run.sh` converts SmolLM2-135M-Instruct to
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # create a random tiny test model at `path` when it is absent (tests and benchmarks ask for it)
    create_tiny: Literal["off", "llama", "qwen2"] = "off"
    max_model_len: int | None = None


@dataclass(frozen=True)
class EngineSection:
    """How each worker runs the model forward (docs/engine_speed.md)."""

    # torch.compile the decoder around the opaque paged-attention op: auto = on CUDA only
    compile: Literal["auto", "on", "off"] = "auto"
    cuda_graphs: bool = False  # with compile on a CUDA device: capture the dense pieces as CUDA graphs
    # pdserve's CPU kernels, built at start (engine/kernels/cpu_kernel.py): decode and prefill attention (CPU,
    # float32 / bfloat16) and float32 linears on panel-packed weights (every product on an AVX2 host;
    # elsewhere up to 64 rows, beside oneDNN's copy);
    # auto = where they build and run, else torch's paths; on = refuse to start without them; off = torch's
    cpu_kernels: Literal["auto", "on", "off"] = "auto"


@dataclass(frozen=True)
class TLSSection:
    """TLS on the gRPC, HTTP and metrics ports (docs/security.md); files are PEM, relative to cluster.yaml."""

    cert_file: str | None = None  # the router's certificate chain; with key_file turns TLS on
    key_file: str | None = None
    client_ca_file: str | None = None  # mutual TLS: clients must show a certificate this CA signed

    @property
    def enabled(self) -> bool:
        return self.cert_file is not None


StatusAccess = Literal["loopback", "admin", "traffic"]


@dataclass(frozen=True)
class AuthSection:
    """Bearer tokens (docs/security.md); each file holds one token per line, re-read on SIGHUP."""

    tokens_file: str | None = None  # traffic: Generation, /v1/...
    admin_tokens_file: str | None = None  # Admin/Scale (anything that changes the cluster); traffic too
    # who may read Admin/Status, reflection and /metrics: loopback (no token from this machine,
    # else an admin token) | admin (an admin token) | traffic (any token)
    status_access: StatusAccess = "loopback"
    # mutual TLS: subjects of client certificates that may administer (Admin/Scale, and Status,
    # reflection, /metrics where status_access asks for admin), as gRPC writes them: "CN=ops,O=acme"
    admin_subjects: list[str] = field(default_factory=list)
    # each caller (token, else client certificate) gets its own prefix cache: requests of different
    # callers never share KV blocks, so none can learn another's prompts from cached_tokens or TTFT.
    # null: on when the token files hold more than one token (several tenants), decided at load
    isolate_prefix_cache: bool | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.tokens_file or self.admin_tokens_file)


@dataclass(frozen=True)
class LocalPrefillSection:
    """Conditional disaggregation (router/lifecycle/local_prefill.py): a disaggregated request's
    prefill runs on its decode worker, chunked as colocated, when the part of its context that
    worker does not hold cached is at most `max_uncached_tokens` (0 = never for length), or, with
    `when_prefill_wait_exceeds`, when the prefill pool's work ahead of it (in tokens) is more than
    the local prefill would cost (its uncached tokens) and that decode worker computes no other
    long local prefill: auto = more than its cost, a number k = more than k times it, off = never."""

    max_uncached_tokens: int = 0
    when_prefill_wait_exceeds: Literal["auto", "off"] | float = "off"


@dataclass(frozen=True)
class RouterSection:
    host: str = "127.0.0.1"
    port: int = 50051
    metrics_port: int | None = None  # Prometheus endpoint; None = off, 0 = pick a free port
    http_port: int | None = None  # OpenAI-compatible HTTP API (router/frontdoor/openai_server.py); None = off, 0 = any free port
    max_queue: int = 256  # requests waiting for capacity; beyond: RESOURCE_EXHAUSTED
    shutdown_grace_s: float = 10.0
    max_prefill_inflight: int = 8  # requests on one prefill worker (or colocated worker) at once
    migration_limit: int = 3  # times a request moves to another worker after a failure
    # start the prefill while the decode reservation is in flight (its KV leaves once the
    # reservation is back): one router -> worker round trip less in TTFT (router/lifecycle/attempt.py)
    prefill_during_reserve: bool = True
    # when a disaggregated request reserves its decode KV: before_prefill (before its prompt is
    # computed) or after_prefill (its prefill worker computes first and holds the KV until a decode
    # worker has room: the prefill pool's memory is the queue's buffer; router/lifecycle/prefill_first.py)
    decode_reservation: DecodeReservation = "before_prefill"
    call_timeout_s: float = 10.0  # deadline of every short router -> worker call
    # deadline of one prefill, queueing on the worker included; also how long a decode stream may
    # send nothing (no token, finish or failure) before its request moves to another worker
    prefill_timeout_s: float = 60.0
    queue_timeout_s: float = 120.0  # longest wait for capacity before UNAVAILABLE; a predicted longer one: 429 at once
    drain_timeout_s: float = 60.0  # then a draining worker's requests migrate
    worker_start_timeout_s: float = 180.0  # a worker that is not ready by then is killed
    unresponsive_s: float = 30.0  # a worker silent, or whose engine made no progress, this long is replaced
    restart_backoff_s: float = 1.0  # first delay before replacing a dead worker; doubles, max 30 s
    max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES  # refused before tokenizing
    # work before admission (router/lifecycle/intake.py): requests being rendered / tokenized at
    # once (beyond: RESOURCE_EXHAUSTED), and threads tokenizing big inputs (small ones have their own)
    max_preparing: int = 64
    tokenizer_threads: int = 1
    # front doors: calls / HTTP requests at once (gRPC beyond: RESOURCE_EXHAUSTED, HTTP: 503), and how
    # long a client may take to send an HTTP request head (else the connection closes) or body (408), or
    # to finish a gRPC connection's handshake
    max_concurrent_calls: int = 1024
    read_timeout_s: float = 30.0
    # front doors, hostile clients (docs/security.md "Slow and silent clients"): how long a client
    # may take nothing of a response it stopped reading (then its connection / call ends and its
    # request is cancelled); connections open at once per door (beyond: closed as they open); bytes
    # of HTTP request bodies being read and parsed at once (beyond: 429 before reading); the most
    # replicas Admin/Scale may ask of a pool
    write_timeout_s: float = 30.0
    max_connections: int = 2048
    # one client address's share (nginx's limit_conn per $binary_remote_addr): HTTP connections open
    # at once (beyond: closed as they open); gRPC Generate calls at once (beyond: RESOURCE_EXHAUSTED;
    # gRPC Python shows calls, not connections)
    max_connections_per_address: int = 256
    max_body_bytes_in_flight: int = 32 << 20
    max_pool_replicas: int = 64
    # placement (router/pools/placement.py): cache_aware weighs the prefix a worker holds against its
    # load; load = least loaded; round_robin = in turn. The per-pool keys override `policy`.
    policy: Policy = "cache_aware"
    prefill_policy: Policy | None = None
    decode_policy: Policy | None = None
    # append one JSON line per finished request (router/observability/request_log.py): timings, lengths and
    # 512-token block hashes, a Mooncake-format trace for `pdserve inspect` and `pdserve bench
    # --trace`; relative to cluster.yaml; null = off. Prompts only with request_log_prompts.
    request_log: str | None = None
    request_log_prompts: bool = False
    local_prefill: LocalPrefillSection = field(default_factory=LocalPrefillSection)
    tls: TLSSection = field(default_factory=TLSSection)
    auth: AuthSection = field(default_factory=AuthSection)
    # the SLO planner: sizes the prefill and decode pools for the coming load (docs/autoscale.md); off by default
    autoscale: AutoscaleSection = field(default_factory=AutoscaleSection)

    def policy_for(self, pool: str) -> str:
        own = self.prefill_policy if pool == "prefill" else self.decode_policy
        return own or self.policy


@dataclass(frozen=True)
class PoolSection:
    replicas: int = 1
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    # where the pool's workers may run (docs/deploy.md): each worker takes this much of these Ray
    # custom resources (e.g. {prefill_node: 1}: only nodes started with that resource) and runs
    # only on a node whose Ray labels match the selector ({role: decode}, {zone: "in(a,b)"}, "!x")
    resources: dict[str, float] = field(default_factory=dict)
    label_selector: dict[str, str] = field(default_factory=dict)
    # intra-op threads per worker: auto = num_cpus (twice that for a colocated worker), at most the
    # node's cores, 1 when pinned (`cpus`); the measured rule: docs/engine_speed.md "Threads"
    torch_threads: int | Literal["auto"] = "auto"
    # pin the pool's workers to these CPU cores, one core per worker in turn (null = no pinning)
    cpus: list[int] | None = None
    num_blocks: int | None = None  # KV blocks per worker of this pool; null = kv_cache's sizing
    malloc: str = "auto"  # a CPU worker's allocator: auto (tcmalloc where this host has it) | tcmalloc | system


@dataclass(frozen=True)
class KVCacheSection:
    block_size: int = 16
    num_blocks: int | None = None  # explicit pool size per worker
    memory: str | None = None  # e.g. "512MiB" per worker; else memory_fraction of the device
    memory_fraction: float = DEFAULT_MEMORY_FRACTION
    runtime_overhead: str = "256MiB"
    prefix_caching: bool = True  # reuse the KV of full blocks other requests computed (engine/kv_cache.py)


# A step's token budget by device (`scheduler.max_num_batched_tokens: auto`). A request that reaches
# a worker mid-step waits for that step, so the budget bounds every arrival's wait: on a CPU a
# 2,048-token float32 step runs ~2 s on two cores, and 512 tokens held served TTFT p50 to about
# half at the same throughput (docs/engine_speed.md "The step's token budget"). A GPU runs 8,192
# tokens in tens of milliseconds, and smaller steps would leave it underused (vLLM's GPU default).
CPU_STEP_TOKENS = 512
GPU_STEP_TOKENS = 8192


@dataclass(frozen=True)
class SchedulerSection:
    # a step's token budget; auto: CPU_STEP_TOKENS on a CPU, GPU_STEP_TOKENS on a GPU (real or emulated)
    max_num_batched_tokens: int | Literal["auto"] = "auto"
    chunk_size: int | None = 256  # null/off = whole prompts
    max_num_seqs: int = 64
    max_num_partial_prefills: int | None = None  # prompts part-way through their prefill at once; null = no limit
    # a disaggregated prefill worker (every running request prefill-only) cuts prompts into chunk_size
    # chunks too; false = whole prompts there, within the step's budget (docs/engine_speed.md)
    chunk_prefill_workers: bool = False


@dataclass(frozen=True)
class KVTransferSection:
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    timeout_s: float = 30.0
    checksum: bool = False
    # the NIC the KV channels use on every node (its IPv4 address is bound and advertised;
    # GLOO_/NCCL_SOCKET_IFNAME follow it); null = each node's Ray node IP
    interface: str | None = None
    # send each prefill chunk's finished blocks while the next chunk computes (false: all after
    # the first token)
    stream_chunks: bool = True


@dataclass(frozen=True)
class RaySection:
    address: str = ""  # "" = start a local head; "auto" or host:port = join
    num_cpus: int | None = None
    object_store_memory: str = "256MiB"


@dataclass(frozen=True)
class ClusterConfig:
    model: ModelSection = field(default_factory=ModelSection)
    engine: EngineSection = field(default_factory=EngineSection)
    mode: Literal["disaggregated", "colocated"] = "disaggregated"
    router: RouterSection = field(default_factory=RouterSection)
    prefill: PoolSection = field(default_factory=PoolSection)
    decode: PoolSection = field(default_factory=PoolSection)
    kv_cache: KVCacheSection = field(default_factory=KVCacheSection)
    scheduler: SchedulerSection = field(default_factory=SchedulerSection)
    kv_transfer: KVTransferSection = field(default_factory=KVTransferSection)
    ray: RaySection = field(default_factory=RaySection)
    faults: FaultConfig = field(default_factory=FaultConfig)  # fault injection, off by default
    emulate: EmulateSection = field(default_factory=EmulateSection)  # emulated devices, off by default

    @staticmethod
    def device_of(pool: PoolSection) -> str:
        """The device type a worker of `pool` runs on."""
        return "cuda" if pool.num_gpus else "cpu"

    def step_tokens(self, pool: PoolSection) -> int:
        """A step's token budget on a worker of `pool` (`scheduler.max_num_batched_tokens`, its
        `auto` by the device: a GPU when the pool has GPUs or the cluster emulates one)."""
        budget = self.scheduler.max_num_batched_tokens
        if budget != "auto":
            return budget
        return GPU_STEP_TOKENS if pool.num_gpus or self.emulate.device is not None else CPU_STEP_TOKENS

    def engine_config(self, pool: PoolSection, device: str = "cpu") -> EngineConfig:
        kv = self.kv_cache
        return EngineConfig(
            model_path=self.model.path, dtype=self.model.dtype, device=device, block_size=kv.block_size,
            num_blocks=pool.num_blocks or kv.num_blocks or emulated_num_blocks(self.emulate, kv.block_size), kv_cache_memory=parse_bytes(kv.memory) if kv.memory else None,
            memory_fraction=kv.memory_fraction, runtime_overhead=parse_bytes(kv.runtime_overhead),
            max_num_batched_tokens=self.step_tokens(pool), chunk_size=self.scheduler.chunk_size,
            max_num_partial_prefills=self.scheduler.max_num_partial_prefills,
            chunk_prefill_workers=self.scheduler.chunk_prefill_workers,
            max_num_seqs=self.scheduler.max_num_seqs, max_model_len=self.model.max_model_len,
            torch_threads=None if pool.torch_threads == "auto" else pool.torch_threads,
            enable_prefix_caching=kv.prefix_caching,
            compile=self.engine.compile, cuda_graphs=self.engine.cuda_graphs,
            cpu_kernels=self.engine.cpu_kernels)


