"""The checks of a cluster.yaml that its types cannot say: ranges, Ray placement syntax,
interface names, sizes, emulated KV pools this host's RAM can hold, and the router's TLS / auth
files (read and verified at load, so a bad file is a config error rather than a failure once the
cluster runs).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import ssl
from pathlib import Path
from typing import TYPE_CHECKING, Any

from protocol.sizes import PlanError, format_bytes, parse_bytes
from router.config.emulate import check_emulate, emulated_num_blocks
from router.config.typed_yaml import ConfigError
from router.frontdoor.access import TokenFileError, read_tokens
from sizing.kv_pool import resolve_dtype
from sizing.memory import ModelShape, dtype_bytes, kv_bytes_per_token
from worker_runtime.malloc import MALLOCS, NO_TCMALLOC, tcmalloc

if TYPE_CHECKING:
    from router.config.schema import AuthSection, ClusterConfig, PoolSection, TLSSection


def check_values(cfg: ClusterConfig, where: str) -> None:
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
        ("router.max_preparing", cfg.router.max_preparing >= 1, "must be >= 1"),
        ("router.tokenizer_threads", cfg.router.tokenizer_threads >= 1, "must be >= 1"),
        ("router.max_concurrent_calls", cfg.router.max_concurrent_calls >= 1, "must be >= 1"),
        ("router.read_timeout_s", cfg.router.read_timeout_s > 0, "must be > 0"),
        ("router.write_timeout_s", cfg.router.write_timeout_s > 0, "must be > 0"),
        ("router.max_connections", cfg.router.max_connections >= 1, "must be >= 1"),
        ("router.max_connections_per_address", cfg.router.max_connections_per_address >= 1, "must be >= 1"),
        ("router.max_body_bytes_in_flight",  # one maximal HTTP body (router/frontdoor/openai_server.py)
         cfg.router.max_body_bytes_in_flight >= 4 * cfg.router.max_prompt_bytes + (64 << 10),
         "must hold one maximal HTTP body: at least 4 x router.max_prompt_bytes + 64 KiB"),
        ("router.max_pool_replicas", cfg.router.max_pool_replicas >= 1, "must be >= 1"),
        ("router.local_prefill.max_uncached_tokens", cfg.router.local_prefill.max_uncached_tokens >= 0,
         "must be >= 0 (0: no request is prefilled locally for being short)"),
        ("router.local_prefill.when_prefill_wait_exceeds",
         isinstance(cfg.router.local_prefill.when_prefill_wait_exceeds, str)
         or cfg.router.local_prefill.when_prefill_wait_exceeds > 0,
         "must be auto, off or a factor > 0 of the local prefill's cost"),
        ("prefill.replicas", cfg.prefill.replicas >= (1 if cfg.mode == "disaggregated" else 0),
         "must be >= 1 in disaggregated mode (>= 0 in colocated)"),
        ("decode.replicas", cfg.decode.replicas >= 1, "must be >= 1"),
        ("prefill.num_cpus", cfg.prefill.num_cpus >= 0, "must be >= 0"),
        ("decode.num_cpus", cfg.decode.num_cpus >= 0, "must be >= 0"),
        ("prefill.num_gpus", cfg.prefill.num_gpus >= 0, "must be >= 0"),
        ("decode.num_gpus", cfg.decode.num_gpus >= 0, "must be >= 0"),
        ("prefill.malloc", cfg.prefill.malloc in MALLOCS, "must be auto, tcmalloc or system"),
        ("decode.malloc", cfg.decode.malloc in MALLOCS, "must be auto, tcmalloc or system"),
        ("prefill.malloc", cfg.prefill.malloc != "tcmalloc" or tcmalloc() is not None, NO_TCMALLOC),
        ("decode.malloc", cfg.decode.malloc != "tcmalloc" or tcmalloc() is not None, NO_TCMALLOC),
        ("prefill.torch_threads", cfg.prefill.torch_threads == "auto" or cfg.prefill.torch_threads >= 1,
         "must be auto or >= 1"),
        ("decode.torch_threads", cfg.decode.torch_threads == "auto" or cfg.decode.torch_threads >= 1,
         "must be auto or >= 1"),
        ("prefill.cpus", not cfg.prefill.cpus or min(cfg.prefill.cpus) >= 0, "core numbers must be >= 0"),
        ("decode.cpus", not cfg.decode.cpus or min(cfg.decode.cpus) >= 0, "core numbers must be >= 0"),
        ("kv_cache.block_size", cfg.kv_cache.block_size >= 1, "must be >= 1"),
        ("kv_cache.num_blocks", cfg.kv_cache.num_blocks is None or cfg.kv_cache.num_blocks >= 1, "must be >= 1"),
        ("prefill.num_blocks", cfg.prefill.num_blocks is None or cfg.prefill.num_blocks >= 1, "must be >= 1"),
        ("decode.num_blocks", cfg.decode.num_blocks is None or cfg.decode.num_blocks >= 1, "must be >= 1"),
        ("kv_cache.memory_fraction", 0 < cfg.kv_cache.memory_fraction <= 1, "must be in (0, 1]"),
        ("scheduler.max_num_batched_tokens", cfg.scheduler.max_num_batched_tokens == "auto"
         or cfg.scheduler.max_num_batched_tokens >= 1, "must be auto or >= 1"),
        ("scheduler.chunk_size", cfg.scheduler.chunk_size is None or cfg.scheduler.chunk_size >= 1,
         "must be >= 1, or off"),
        ("scheduler.max_num_seqs", cfg.scheduler.max_num_seqs >= 1, "must be >= 1"),
        ("scheduler.max_num_partial_prefills",
         cfg.scheduler.max_num_partial_prefills is None or cfg.scheduler.max_num_partial_prefills >= 1,
         "must be >= 1, or null (no limit)"),
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
    check_emulate(cfg.emulate, cfg.kv_cache.block_size, where)
    check_autoscale(cfg, where)


HOST_RAM_SHARE = 0.5  # of this host's physical memory the emulated KV pools may take, all workers together


def check_host_memory(cfg: ClusterConfig, where: str, host_bytes: int | None = None) -> None:
    """The emulated pools hold the REAL model's KV: refuse a config whose pools, all workers
    together, would take more than HOST_RAM_SHARE of this host's memory. Skipped when the pool
    size is explicit (kv_cache.num_blocks) or the model's config.json is not there yet."""
    blocks = None if cfg.kv_cache.num_blocks else emulated_num_blocks(cfg.emulate, cfg.kv_cache.block_size)
    real = _real_kv_bytes_per_token(cfg)
    if blocks is None or real is None:
        return
    workers = cfg.decode.replicas + (cfg.prefill.replicas if cfg.mode == "disaggregated" else 0)
    need = workers * blocks * cfg.kv_cache.block_size * real
    host = host_bytes if host_bytes is not None else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > HOST_RAM_SHARE * host:
        raise ConfigError(
            f"{where}: emulate: {workers} workers x {blocks * cfg.kv_cache.block_size:,} emulated KV tokens x "
            f"{format_bytes(real)} per token of the real model need {format_bytes(need)} of host RAM, over "
            f"{HOST_RAM_SHARE:.0%} of this host's {format_bytes(host)}: set kv_cache.num_blocks, emulate.memory, "
            f"or use a smaller real model")


def _real_kv_bytes_per_token(cfg: ClusterConfig) -> int | None:
    try:
        config = json.loads((Path(cfg.model.path) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    dtype = resolve_dtype(cfg.model.dtype, cfg.device_of(cfg.decode))
    try:
        return kv_bytes_per_token(ModelShape.from_hf_config(config, num_params=0), dtype_bytes(dtype))
    except PlanError:
        return None


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


def security_files(cfg: ClusterConfig, base: Path, where: str) -> ClusterConfig:
    """router.tls and router.auth with their files made absolute, each read and checked now."""
    def resolve(section) -> Any:
        files = {f.name: str(base / v) for f in dataclasses.fields(section)
                 if f.name.endswith("_file") and (v := getattr(section, f.name)) is not None}
        return dataclasses.replace(section, **files)

    tls, auth = resolve(cfg.router.tls), resolve(cfg.router.auth)
    tokens = 0
    for key, path in [*(("tls." + k, getattr(tls, k)) for k in ("cert_file", "key_file", "client_ca_file")),
                      *(("auth." + k, getattr(auth, k)) for k in ("tokens_file", "admin_tokens_file"))]:
        try:
            if path is not None and key.startswith("auth."):
                tokens += len(read_tokens(path))
            elif path is not None:
                Path(path).read_bytes()
        except (OSError, TokenFileError) as e:
            reason = e if isinstance(e, TokenFileError) else f"{path}: cannot read: {e.strerror}"
            raise ConfigError(f"{where}: router.{key}: {reason}") from None
    if auth.isolate_prefix_cache is None:  # several tenants' tokens: each its own cache by default
        auth = dataclasses.replace(auth, isolate_prefix_cache=tokens > 1)
    _check_tls(tls, where)
    _check_identities(tls, auth, cfg.router.http_port is not None, where)
    return dataclasses.replace(cfg, router=dataclasses.replace(cfg.router, tls=tls, auth=auth))


def _check_identities(tls: TLSSection, auth: AuthSection, http: bool, where: str) -> None:
    """Options that name callers need a way to tell callers apart (the HTTP door sees no
    certificate subject: there only tokens do)."""
    if auth.admin_subjects and tls.client_ca_file is None:
        raise ConfigError(f"{where}: router.auth.admin_subjects: certificate subjects need mutual TLS "
                          "(router.tls.client_ca_file)")
    if auth.isolate_prefix_cache and not (auth.enabled or tls.client_ca_file):
        raise ConfigError(f"{where}: router.auth.isolate_prefix_cache: callers are told apart by their token or "
                          "client certificate: set router.auth.tokens_file or router.tls.client_ca_file")
    if auth.isolate_prefix_cache and http and not auth.enabled:
        raise ConfigError(f"{where}: router.auth.isolate_prefix_cache: the HTTP door tells callers apart by token "
                          "only: set router.auth.tokens_file, or router.http_port: null")


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


def check_autoscale(cfg: ClusterConfig, where: str) -> None:
    """Ranges, the bounds against each other and the budget, and what the profile needs."""
    a, key = cfg.router.autoscale, "router.autoscale."
    disagg = cfg.mode == "disaggregated"
    rules = [
        ("ttft_s", a.ttft_s > 0, "must be > 0"),
        ("itl_s", a.itl_s > 0, "must be > 0"),
        ("percentile", 0 < a.percentile <= 100, "must be in (0, 100]"),
        ("prefill_min", a.prefill_min >= 1 or not disagg, "must be >= 1: the prefill pool is needed"),
        ("prefill_max", a.prefill_max >= a.prefill_min, "must be >= prefill_min"),
        ("decode_min", a.decode_min >= 1, "must be >= 1: the decode pool is needed"),
        ("decode_max", a.decode_max >= a.decode_min, "must be >= decode_min"),
        ("prefill_max", a.prefill_max <= cfg.router.max_pool_replicas, "must be <= router.max_pool_replicas"),
        ("decode_max", a.decode_max <= cfg.router.max_pool_replicas, "must be <= router.max_pool_replicas"),
        ("max_workers", a.max_workers is None or a.max_workers >= 1, "must be >= 1"),
        ("max_cost_per_hour", a.max_cost_per_hour is None or a.max_cost_per_hour > 0, "must be > 0"),
        ("cost_per_worker_hour", a.cost_per_worker_hour > 0, "must be > 0"),
        ("interval_s", a.interval_s > 0, "must be > 0"),
        ("scale_up_cooldown_s", a.scale_up_cooldown_s >= 0, "must be >= 0"),
        ("scale_down_cooldown_s", a.scale_down_cooldown_s >= 0, "must be >= 0"),
        ("band", 0 <= a.band < 1, "must be in [0, 1)"),
        ("target_utilization", 0 < a.target_utilization <= 1, "must be in (0, 1]"),
        ("kv_high", 0 < a.kv_high <= 1, "must be in (0, 1]"),
        ("warmup_s", a.warmup_s >= 0, "must be >= 0"),
    ]
    for name, ok, reason in rules:
        if not ok:
            raise ConfigError(f"{where}: {key}{name}: {reason}")
    if not a.enabled:
        return
    floor = a.decode_min + (a.prefill_min if disagg else 0)
    budget = a.budget_workers
    if budget is not None and budget < floor:
        what = "max_workers" if a.max_workers is not None and a.max_workers < floor else "max_cost_per_hour"
        raise ConfigError(f"{where}: {key}{what}: the budget ({budget} workers) is below the pools' minimum "
                          f"({floor} workers: decode_min{' + prefill_min' if disagg else ''})")
    if a.profile == "cost_model" and cfg.emulate.device is None:
        raise ConfigError(f"{where}: {key}profile: cost_model needs an emulated device (emulate.device); "
                          "use online (learned from the workers' steps) or measured (measured_profile)")
    if a.profile == "measured" and a.measured_profile is None:
        raise ConfigError(f"{where}: {key}measured_profile: profile measured needs the file "
                          "`pdserve plan --measure` wrote its emulate: section to")
