"""The `emulate:` section of cluster.yaml resolved into what the workers pace by
(`sizing.cost_model.Emulation`), the KV pool each worker gets (the blocks the emulated model
leaves on the emulated device, as `pdserve plan` budgets them), and the checks: values in
range, and a pool that this host's RAM can hold for the real model's KV (else a config error).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from kv_transfer import LinkPace
from protocol.sizes import PlanError, parse_bytes
from router.config.typed_yaml import ConfigError
from sizing.cost_model import CostModel, Emulation, LinkModel
from sizing.devices import DEVICES, DeviceProfile, parse_rate
from sizing.memory import BUILTIN_SHAPES, ModelShape, dtype_bytes, plan_memory

CUSTOM = "custom"


@dataclass(frozen=True)
class EmulateSection:
    """Run the real cluster at an emulated device's timings (docs/architecture.md, "Emulation"):
    each engine step, KV transfer and worker start takes the time the cost model gives for the
    emulated model on the emulated device (sizing/cost_model.py); the real model computes the
    tokens. Off while `device` is null."""

    device: str | None = None  # h100 | h200 | a100 | l40s (sizing/devices.py) | custom; null = off
    model: str = "llama-3.1-8b"  # a built-in shape (sizing/memory.py) or a checkpoint directory
    dtype: str = "bfloat16"  # the emulated weights' and KV's dtype
    bandwidth: str | None = None  # overrides the device's memory bandwidth, e.g. 3.35TB/s
    flops: str | None = None  # overrides the device's dense FLOP/s, e.g. 989TFLOPs
    memory: str | None = None  # overrides the device's memory, e.g. 80GiB
    overhead: str = "8GiB"  # activations and runtime on the emulated device (as `pdserve plan --overhead`)
    bandwidth_efficiency: float = 0.8  # share of the bandwidth a step's reads get
    compute_efficiency: float = 0.6  # share of the peak FLOP/s a step's matmuls get
    step_overhead_s: float = 0.001  # added to every step: launches, scheduling, sampling
    link: str = "400Gbit"  # prefill -> decode KV link
    link_latency_s: float = 0.00005  # added to every KV transfer
    load_bandwidth: str = "5GB/s"  # weights into device memory at worker start-up
    # every modelled duration (and `pdserve bench`'s arrivals) stretched by this; reports divide back
    time_scale: float = 1.0


def emulated_shape(model: str) -> ModelShape:
    """A built-in shape, or one read from a checkpoint directory's config.json."""
    if model in BUILTIN_SHAPES:
        return BUILTIN_SHAPES[model]
    path = Path(model) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise PlanError(f"{model!r} is neither a built-in shape ({', '.join(BUILTIN_SHAPES)}) nor a checkpoint "
                        f"directory with a readable config.json ({err})") from None
    return ModelShape.from_hf_config(config, name=Path(model).name)


def device_profile(sec: EmulateSection) -> DeviceProfile:
    """The named device with the section's overrides; `custom` needs all three."""
    if sec.device == CUSTOM:
        if not (sec.bandwidth and sec.flops and sec.memory):
            raise PlanError("device custom needs bandwidth, flops and memory")
        base = DeviceProfile(CUSTOM, 1.0, 1.0, sec.memory, "emulate: bandwidth, flops, memory")
    elif sec.device in DEVICES:
        base = DEVICES[sec.device]
    else:
        raise PlanError(f"unknown device {sec.device!r}; known: {', '.join([*DEVICES, CUSTOM])}")
    return dataclasses.replace(
        base,
        bandwidth=parse_rate(sec.bandwidth, "bandwidth") if sec.bandwidth else base.bandwidth,
        flops=parse_rate(sec.flops, "flops") if sec.flops else base.flops,
        memory=sec.memory or base.memory)


def emulation(sec: EmulateSection) -> Emulation | None:
    """The resolved emulation, None when it is off. Raises PlanError on a bad value."""
    if sec.device is None:
        return None
    cost = CostModel(emulated_shape(sec.model), device_profile(sec), dtype_bytes(sec.dtype),
                     sec.bandwidth_efficiency, sec.compute_efficiency, sec.step_overhead_s)
    return Emulation(cost, LinkModel(parse_rate(sec.link, "link"), sec.link_latency_s),
                     parse_rate(sec.load_bandwidth, "load_bandwidth"), sec.time_scale)


def emulated_num_blocks(sec: EmulateSection, block_size: int) -> int | None:
    """KV blocks per worker: what the emulated model leaves of the emulated device's memory
    after weights and overhead; None when emulation is off."""
    em = emulation(sec)
    if em is None:
        return None
    plan = plan_memory(em.cost.shape, em.cost.dtype_bytes, parse_bytes(em.cost.device.memory),
                       parse_bytes(sec.overhead), 1, block_size=block_size)
    return plan.num_blocks


def check_emulate(sec: EmulateSection, block_size: int, where: str) -> None:
    """Ranges and names of the section (nothing when it is off)."""
    if sec.device is None:
        return
    rules = [
        ("bandwidth_efficiency", 0 < sec.bandwidth_efficiency <= 1, "must be in (0, 1]"),
        ("compute_efficiency", 0 < sec.compute_efficiency <= 1, "must be in (0, 1]"),
        ("step_overhead_s", sec.step_overhead_s >= 0, "must be >= 0"),
        ("link_latency_s", sec.link_latency_s >= 0, "must be >= 0"),
        ("time_scale", sec.time_scale >= 1, "must be >= 1 (it stretches modelled time; the report divides back)"),
    ]
    for key, ok, reason in rules:
        if not ok:
            raise ConfigError(f"{where}: emulate.{key}: {reason}")
    try:
        parse_bytes(sec.overhead)
        emulated_num_blocks(sec, block_size)
    except PlanError as err:
        raise ConfigError(f"{where}: emulate: {err}") from None


def link_pace(em: Emulation | None, block_size: int) -> LinkPace | None:
    """What the KV sender holds each transfer for: the emulated model's KV of the blocks moved
    over the emulated link."""
    if em is None:
        return None
    return LinkPace(block_size * em.cost.kv_bytes_per_token, em.link.bytes_per_s, em.link.latency_s, em.time_scale)
