"""cluster.yaml: one validated schema for the whole cluster.

`load_config(path)` reads YAML into frozen dataclasses and refuses, with one message naming
the key, any unknown key, wrong type or impossible value (`ConfigError`; the CLI exits 2).
Sizes accept "512MiB"-style strings. Relative `model.path` is relative to the file, and so are
the router.tls / router.auth files, read and checked at load (the certificate matches its key,
the tokens are well formed): a bad one is a config error, not a failure once the cluster runs.
"""

from __future__ import annotations

import dataclasses
import re
import ssl
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from engine.config import EngineConfig
from engine.faults import FaultConfig
from engine.limits import DEFAULT_MAX_PROMPT_BYTES
from engine.memory import PlanError, parse_bytes
from router.auth import TokenFileError, read_tokens


class ConfigError(ValueError):
    """A bad cluster.yaml; the message names the key and the reason."""


Policy = Literal["cache_aware", "load", "round_robin"]


@dataclass(frozen=True)
class ModelSection:
    path: str = "models/tiny-llama"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # create the embedded tiny model at `path` when it is absent (the default cluster does)
    create_tiny: Literal["off", "llama", "qwen2"] = "off"
    max_model_len: int | None = None


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

    @property
    def enabled(self) -> bool:
        return bool(self.tokens_file or self.admin_tokens_file)


@dataclass(frozen=True)
class RouterSection:
    host: str = "127.0.0.1"
    port: int = 50051
    metrics_port: int | None = None  # Prometheus endpoint; None = off, 0 = pick a free port
    http_port: int | None = None  # OpenAI-compatible HTTP API (router/openai_api.py); None = off, 0 = any free port
    max_queue: int = 256  # requests waiting for capacity; beyond: RESOURCE_EXHAUSTED
    shutdown_grace_s: float = 10.0
    max_prefill_inflight: int = 8  # requests on one prefill worker (or colocated worker) at once
    migration_limit: int = 3  # times a request moves to another worker after a failure
    # start the prefill while the decode reservation is in flight (its KV leaves once the
    # reservation is back): one router -> worker round trip less in TTFT (router/attempt.py)
    prefill_during_reserve: bool = True
    call_timeout_s: float = 10.0  # deadline of every short router -> worker call
    prefill_timeout_s: float = 60.0  # deadline of one prefill, queueing on the worker included
    queue_timeout_s: float = 120.0  # longest wait for capacity before UNAVAILABLE
    drain_timeout_s: float = 60.0  # then a draining worker's requests migrate
    worker_start_timeout_s: float = 180.0  # a worker that is not ready by then is killed
    unresponsive_s: float = 30.0  # a worker that answers no stats call for this long is replaced
    restart_backoff_s: float = 1.0  # first delay before replacing a dead worker; doubles, max 30 s
    max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES  # refused before tokenizing
    # placement (router/placement.py): cache_aware weighs the prefix a worker holds against its
    # load; load = least loaded; round_robin = in turn. The per-pool keys override `policy`.
    policy: Policy = "cache_aware"
    prefill_policy: Policy | None = None
    decode_policy: Policy | None = None
    # append one JSON line per finished request (router/request_log.py): timings, lengths and
    # 512-token block hashes, a Mooncake-format trace for `pdserve inspect` and `pdserve bench
    # --trace`; relative to cluster.yaml; null = off. Prompts only with request_log_prompts.
    request_log: str | None = None
    request_log_prompts: bool = False
    tls: TLSSection = field(default_factory=TLSSection)
    auth: AuthSection = field(default_factory=AuthSection)

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
    torch_threads: int = 1
    # pin the pool's workers to these CPU cores, one core per worker in turn (null = no pinning)
    cpus: list[int] | None = None


@dataclass(frozen=True)
class KVCacheSection:
    block_size: int = 16
    num_blocks: int | None = None  # explicit pool size per worker
    memory: str | None = None  # e.g. "512MiB" per worker; else memory_fraction of the device
    memory_fraction: float = 0.1
    runtime_overhead: str = "256MiB"
    prefix_caching: bool = True  # reuse the KV of full blocks other requests computed (engine/kv_cache.py)


@dataclass(frozen=True)
class SchedulerSection:
    max_num_batched_tokens: int = 512
    chunk_size: int | None = 256  # null/off = whole prompts
    max_num_seqs: int = 64


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
    mode: Literal["disaggregated", "colocated"] = "disaggregated"
    router: RouterSection = field(default_factory=RouterSection)
    prefill: PoolSection = field(default_factory=PoolSection)
    decode: PoolSection = field(default_factory=PoolSection)
    kv_cache: KVCacheSection = field(default_factory=KVCacheSection)
    scheduler: SchedulerSection = field(default_factory=SchedulerSection)
    kv_transfer: KVTransferSection = field(default_factory=KVTransferSection)
    ray: RaySection = field(default_factory=RaySection)
    faults: FaultConfig = field(default_factory=FaultConfig)  # fault injection, off by default

    def engine_config(self, pool: PoolSection, device: str = "cpu") -> EngineConfig:
        kv = self.kv_cache
        return EngineConfig(
            model_path=self.model.path, dtype=self.model.dtype, device=device, block_size=kv.block_size,
            num_blocks=kv.num_blocks, kv_cache_memory=parse_bytes(kv.memory) if kv.memory else None,
            memory_fraction=kv.memory_fraction, runtime_overhead=parse_bytes(kv.runtime_overhead),
            max_num_batched_tokens=self.scheduler.max_num_batched_tokens, chunk_size=self.scheduler.chunk_size,
            max_num_seqs=self.scheduler.max_num_seqs, max_model_len=self.model.max_model_len,
            torch_threads=pool.torch_threads, enable_prefix_caching=kv.prefix_caching)


def load_config(path: str | Path) -> ClusterConfig:
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    cfg = parse_config(raw, where=str(path), base_dir=path.parent)
    model_path = Path(cfg.model.path)
    if not model_path.is_absolute():
        model_path = (path.parent / model_path).resolve()
    if cfg.router.request_log is not None:
        cfg = dataclasses.replace(cfg, router=dataclasses.replace(
            cfg.router, request_log=str((path.parent / cfg.router.request_log).resolve())))
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=str(model_path)))


def parse_config(raw: Any, where: str = "cluster.yaml", base_dir: Path | None = None) -> ClusterConfig:
    """`base_dir`: what relative router.tls / router.auth files are relative to (default: the cwd)."""
    cfg = _build(ClusterConfig, raw, prefix="", where=where)
    _check_values(cfg, where)
    return _security_files(cfg, base_dir or Path.cwd(), where)


def _security_files(cfg: ClusterConfig, base: Path, where: str) -> ClusterConfig:
    """router.tls and router.auth with their files made absolute, each read and checked now."""
    def resolve(section) -> Any:
        files = {f.name: str(base / v) for f in dataclasses.fields(section)
                 if f.name.endswith("_file") and (v := getattr(section, f.name)) is not None}
        return dataclasses.replace(section, **files)

    tls, auth = resolve(cfg.router.tls), resolve(cfg.router.auth)
    for key, path in [*(("tls." + k, getattr(tls, k)) for k in ("cert_file", "key_file", "client_ca_file")),
                      *(("auth." + k, getattr(auth, k)) for k in ("tokens_file", "admin_tokens_file"))]:
        try:
            if path is not None and key.startswith("auth."):
                read_tokens(path)
            elif path is not None:
                Path(path).read_bytes()
        except (OSError, TokenFileError) as e:
            reason = e if isinstance(e, TokenFileError) else f"{path}: cannot read: {e.strerror}"
            raise ConfigError(f"{where}: router.{key}: {reason}") from None
    _check_tls(tls, where)
    return dataclasses.replace(cfg, router=dataclasses.replace(cfg.router, tls=tls, auth=auth))


def _check_tls(tls: TLSSection, where: str) -> None:
    if (tls.cert_file is None) != (tls.key_file is None):
        missing = "key_file" if tls.key_file is None else "cert_file"
        raise ConfigError(f"{where}: router.tls.{missing}: TLS needs both cert_file and key_file")
    if tls.client_ca_file is not None and tls.cert_file is None:
        raise ConfigError(f"{where}: router.tls.client_ca_file: mutual TLS needs cert_file and key_file too")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        if tls.cert_file is not None:
            context.load_cert_chain(tls.cert_file, tls.key_file)
    except ssl.SSLError as e:
        raise ConfigError(f"{where}: router.tls.cert_file: not a PEM certificate chain whose key is "
                          f"router.tls.key_file ({e.reason or e})") from None
    try:
        if tls.client_ca_file is not None:
            context.load_verify_locations(tls.client_ca_file)
    except ssl.SSLError as e:
        raise ConfigError(f"{where}: router.tls.client_ca_file: not PEM CA certificates ({e.reason or e})") from None


def _build(cls, raw: Any, prefix: str, where: str):
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: {prefix.rstrip('.') or 'top level'}: expected a mapping, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise ConfigError(f"{where}: {prefix}{unknown[0]}: unknown key (known: {', '.join(sorted(names))})")
    values = {}
    for key, value in raw.items():
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            values[key] = _build(hint, value if value is not None else {}, f"{prefix}{key}.", where)
        else:
            values[key] = _coerce(hint, value, f"{prefix}{key}", where)
    return cls(**values)


def _coerce(hint, value: Any, key: str, where: str):
    if value == "off" and _allows_none(hint) and "off" not in _literal_values(hint):
        value = None
    if _matches(hint, value):
        return float(value) if hint in (float, float | None) and isinstance(value, int) else value
    raise ConfigError(f"{where}: {key}: expected {_describe(hint)}, got {value!r}")


def _is_union(hint) -> bool:
    return isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union  # X | None, Literal | None


def _allows_none(hint) -> bool:
    return _is_union(hint) and type(None) in hint.__args__


def _literal_values(hint) -> tuple:
    return hint.__args__ if typing.get_origin(hint) is Literal else ()


def _matches(hint, value: Any) -> bool:
    if _is_union(hint):
        return any(_matches(h, value) for h in hint.__args__)
    if hint is type(None):
        return value is None
    if typing.get_origin(hint) is Literal:
        return value in hint.__args__
    if typing.get_origin(hint) is dict:
        return isinstance(value, dict) and all(isinstance(k, str) and _matches(typing.get_args(hint)[1], v)
                                               for k, v in value.items())
    if typing.get_origin(hint) is list:
        return isinstance(value, list) and all(_matches(int, v) for v in value)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def _describe(hint) -> str:
    if _is_union(hint):
        return " or ".join(_describe(h) for h in hint.__args__)
    if hint is type(None):
        return "null"
    if typing.get_origin(hint) is Literal:
        return "one of " + ", ".join(repr(v) for v in hint.__args__)
    if typing.get_origin(hint) is dict:
        return f"a mapping of name to {_describe(typing.get_args(hint)[1])}"
    if typing.get_origin(hint) is list:
        return "a list of integers"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(hint, str(hint))


def _check_values(cfg: ClusterConfig, where: str) -> None:
    rules = [
        ("router.port", 0 <= cfg.router.port <= 65535, "must be a port number 0-65535"),
        ("router.metrics_port", cfg.router.metrics_port is None or 0 <= cfg.router.metrics_port <= 65535,
         "must be a port number 0-65535"),
        ("router.http_port", cfg.router.http_port is None or 0 <= cfg.router.http_port <= 65535,
         "must be a port number 0-65535"),
        ("router.max_queue", cfg.router.max_queue >= 1, "must be >= 1"),
        ("router.shutdown_grace_s", cfg.router.shutdown_grace_s >= 0, "must be >= 0"),
        ("router.max_prefill_inflight", cfg.router.max_prefill_inflight >= 1, "must be >= 1"),
        ("router.migration_limit", cfg.router.migration_limit >= 0, "must be >= 0"),
        ("router.call_timeout_s", cfg.router.call_timeout_s > 0, "must be > 0"),
        ("router.prefill_timeout_s", cfg.router.prefill_timeout_s > 0, "must be > 0"),
        ("router.queue_timeout_s", cfg.router.queue_timeout_s > 0, "must be > 0"),
        ("router.drain_timeout_s", cfg.router.drain_timeout_s >= 0, "must be >= 0"),
        ("router.worker_start_timeout_s", cfg.router.worker_start_timeout_s > 0, "must be > 0"),
        ("router.unresponsive_s", cfg.router.unresponsive_s > 0, "must be > 0"),
        ("router.restart_backoff_s", cfg.router.restart_backoff_s > 0, "must be > 0"),
        ("router.max_prompt_bytes", cfg.router.max_prompt_bytes >= 1, "must be >= 1"),
        ("prefill.replicas", cfg.prefill.replicas >= (1 if cfg.mode == "disaggregated" else 0),
         "must be >= 1 in disaggregated mode (>= 0 in colocated)"),
        ("decode.replicas", cfg.decode.replicas >= 1, "must be >= 1"),
        ("prefill.num_cpus", cfg.prefill.num_cpus >= 0, "must be >= 0"),
        ("decode.num_cpus", cfg.decode.num_cpus >= 0, "must be >= 0"),
        ("prefill.num_gpus", cfg.prefill.num_gpus >= 0, "must be >= 0"),
        ("decode.num_gpus", cfg.decode.num_gpus >= 0, "must be >= 0"),
        ("prefill.torch_threads", cfg.prefill.torch_threads >= 1, "must be >= 1"),
        ("decode.torch_threads", cfg.decode.torch_threads >= 1, "must be >= 1"),
        ("prefill.cpus", not cfg.prefill.cpus or min(cfg.prefill.cpus) >= 0, "core numbers must be >= 0"),
        ("decode.cpus", not cfg.decode.cpus or min(cfg.decode.cpus) >= 0, "core numbers must be >= 0"),
        ("kv_cache.block_size", cfg.kv_cache.block_size >= 1, "must be >= 1"),
        ("kv_cache.num_blocks", cfg.kv_cache.num_blocks is None or cfg.kv_cache.num_blocks >= 1, "must be >= 1"),
        ("kv_cache.memory_fraction", 0 < cfg.kv_cache.memory_fraction <= 1, "must be in (0, 1]"),
        ("scheduler.max_num_batched_tokens", cfg.scheduler.max_num_batched_tokens >= 1, "must be >= 1"),
        ("scheduler.chunk_size", cfg.scheduler.chunk_size is None or cfg.scheduler.chunk_size >= 1,
         "must be >= 1, or off"),
        ("scheduler.max_num_seqs", cfg.scheduler.max_num_seqs >= 1, "must be >= 1"),
        ("kv_transfer.timeout_s", cfg.kv_transfer.timeout_s > 0, "must be > 0"),
        ("kv_transfer.interface",
         cfg.kv_transfer.interface is None or bool(_IFNAME.fullmatch(cfg.kv_transfer.interface)),
         "must be a network interface name (1-15 characters, no spaces or '/'), e.g. eth1"),
        ("model.max_model_len", cfg.model.max_model_len is None or cfg.model.max_model_len >= 2, "must be >= 2"),
    ]
    rules += [(f"faults.{key}", False, reason) for key, reason in cfg.faults.problems()]
    rules += _placement_rules("prefill", cfg.prefill) + _placement_rules("decode", cfg.decode)
    for key, ok, reason in rules:
        if not ok:
            raise ConfigError(f"{where}: {key}: {reason}")
    for key, text in (("kv_cache.memory", cfg.kv_cache.memory), ("kv_cache.runtime_overhead", cfg.kv_cache.runtime_overhead),
                      ("ray.object_store_memory", cfg.ray.object_store_memory)):
        if text is not None:
            try:
                parse_bytes(text)
            except PlanError as e:
                raise ConfigError(f"{where}: {key}: {e}") from None


# Ray's label syntax (Kubernetes-style): a name of alphanumerics with -_. inside, an optional
# DNS prefix before a "/"; a selector value is a label value, "!value", "in(a,b)" or "!in(a,b)".
_LABEL = r"[A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?"
_LABEL_KEY = re.compile(rf"({_LABEL}(\.{_LABEL})*/)?{_LABEL}")
_LABEL_SELECTOR = re.compile(rf"!?({_LABEL}|in\({_LABEL}(, ?{_LABEL})*\))")
_IFNAME = re.compile(r"[^\s/]{1,15}")


def _placement_rules(pool: str, sec: PoolSection) -> list[tuple[str, bool, str]]:
    rules = [(f"{pool}.resources.{name}", name not in ("CPU", "GPU"), f"use {pool}.num_cpus / {pool}.num_gpus")
             for name in sec.resources]
    rules += [(f"{pool}.resources.{name}", amount > 0, "must be > 0") for name, amount in sec.resources.items()]
    rules += [(f"{pool}.label_selector.{key}", bool(_LABEL_KEY.fullmatch(key)),
               "is not a Ray label key (alphanumerics and -_. inside, at most 63, optional prefix/)")
              for key in sec.label_selector]
    rules += [(f"{pool}.label_selector.{key}", bool(_LABEL_SELECTOR.fullmatch(value)),
               f"{value!r} is not a label selector: a value, !value, in(a,b) or !in(a,b)")
              for key, value in sec.label_selector.items()]
    return rules
