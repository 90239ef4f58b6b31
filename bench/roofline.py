"""Roofline arithmetic for `pdserve plan`: what a device's memory bandwidth and FLOP/s allow a model.

A decode step reads every weight once and each request's KV, and does 2 FLOPs per parameter per
request (the weight matmuls; attention's FLOPs are left out — at decode they are far below its
KV reads), so its floor is max(bytes / bandwidth, FLOPs / peak): memory-bound at small batch,
compute-bound once 2 x params x batch / FLOP/s outgrows the reads. Prefill is compute-bound:
at most peak / (2 x params) tokens/s. Moving a context's KV takes at least its bytes over the
link. Device profiles (sizing/devices.py) are datasheet figures (dense bf16, no sparsity); `--bandwidth` /
`--flops` override them and bench/host_measure.py measures this host.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sizing.cost_model import bytes_read, matmul_flops
from sizing.devices import DEVICES, DeviceProfile, parse_rate

__all__ = ["BATCHES", "DEVICES", "DecodeStep", "DeviceProfile", "Roofline", "format_roofline", "parse_rate"]

BATCHES = (1, 8, 32, 128)


@dataclass(frozen=True)
class DecodeStep:
    """The floor of one decode step of `batch` requests with `context` tokens of KV each."""

    batch: int
    bytes_read: int  # weights + every request's KV
    flops: float
    bandwidth: float
    peak_flops: float
    kv_fits: bool  # the batch's KV fits the memory plan's KV budget

    @property
    def memory_s(self) -> float:
        return self.bytes_read / self.bandwidth

    @property
    def compute_s(self) -> float:
        return self.flops / self.peak_flops

    @property
    def step_s(self) -> float:
        return max(self.memory_s, self.compute_s)

    @property
    def bound(self) -> str:
        return "compute" if self.compute_s > self.memory_s else "memory"

    @property
    def tok_s(self) -> float:
        return self.batch / self.step_s

    @property
    def tok_s_per_user(self) -> float:
        return 1 / self.step_s

    def to_dict(self) -> dict:
        return {"batch": self.batch, "step_ms_floor": self.step_s * 1e3, "bound": self.bound, "tok_s": self.tok_s,
                "tok_s_per_user": self.tok_s_per_user, "bytes_read": self.bytes_read, "flops": self.flops,
                "memory_ms": self.memory_s * 1e3, "compute_ms": self.compute_s * 1e3, "kv_fits": self.kv_fits}


@dataclass(frozen=True)
class Roofline:
    """One model on one device profile; every figure derives from these inputs."""

    weights_bytes: int
    num_params: int
    kv_bytes_per_token: int
    context: int
    bandwidth: float
    peak_flops: float
    kv_budget_bytes: int

    def decode(self, batch: int) -> DecodeStep:
        kv = batch * self.context * self.kv_bytes_per_token
        read = bytes_read(self.weights_bytes, self.kv_bytes_per_token, [self.context] * batch)
        return DecodeStep(batch, read, matmul_flops(self.num_params, batch), self.bandwidth,
                          self.peak_flops, kv <= self.kv_budget_bytes)

    def compute_bound_batch(self, context: int | None = None) -> int | None:
        """The smallest batch whose step is compute-bound; None if none is (each request's KV
        read then takes longer than its FLOPs)."""
        context = self.context if context is None else context
        per_request = 2.0 * self.num_params / self.peak_flops - context * self.kv_bytes_per_token / self.bandwidth
        if per_request <= 0:
            return None
        return math.floor(self.weights_bytes / self.bandwidth / per_request) + 1

    @property
    def prefill_tok_s(self) -> float:
        """Compute ceiling of prefill (attention's FLOPs, quadratic in the prompt, left out)."""
        return self.peak_flops / (2.0 * self.num_params)

    @property
    def context_kv_bytes(self) -> int:
        return self.context * self.kv_bytes_per_token

    def transfer_s(self, link_bytes_per_s: float) -> float:
        return self.context_kv_bytes / link_bytes_per_s


def _gb(num_bytes: float) -> str:
    return f"{num_bytes / 1e9:,.2f} GB"


def _rate(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e12:.2f} TB/s" if bytes_per_s >= 1e12 else f"{bytes_per_s / 1e9:.1f} GB/s"


def format_roofline(r: Roofline, device: str, link_bytes_per_s: float) -> str:
    """The roofline lines of `pdserve plan`: weights per step, the decode table, the compute-bound
    batch, the prefill ceiling, the KV transfer of one context."""
    lines = [f"{'roofline':<14} {device}",
             f"{'weights':<14} {_gb(r.weights_bytes)} read every decode step: >= {r.weights_bytes / 1e12 * 1e3:.2f} ms "
             f"at 1 TB/s, >= {r.weights_bytes / r.bandwidth * 1e3:.2f} ms at {_rate(r.bandwidth)}",
             f"{'decode floor':<14} {r.context:,} tokens of KV per request read every step "
             "(floor = the larger of bytes / bandwidth and FLOPs / peak)",
             f"{'batch':>7}{'read':>11}{'memory ms':>11}{'compute ms':>11}{'floor ms':>10}{'bound':>9}"
             f"{'tok/s':>10}{'tok/s/user':>11}  KV"]
    for step in (r.decode(b) for b in BATCHES):
        lines.append(f"{step.batch:>7}{step.bytes_read / 1e9:>8.2f} GB{step.memory_s * 1e3:>11.2f}"
                     f"{step.compute_s * 1e3:>11.2f}{step.step_s * 1e3:>10.2f}{step.bound:>9}{step.tok_s:>10,.0f}"
                     f"{step.tok_s_per_user:>11.1f}  {'fits' if step.kv_fits else 'exceeds the KV budget'}")
    alone, full = r.compute_bound_batch(0), r.compute_bound_batch()
    at_context = (f"from batch {full}" if full is not None
                  else "never: each request's KV read outlasts its FLOPs")
    lines.append(f"{'compute-bound':<14} weights alone: from batch {alone}; with {r.context:,} tokens of context: "
                 f"{at_context}")
    peak = f"{r.peak_flops / 1e12:,.0f} TFLOP/s" if r.peak_flops >= 1e12 else f"{r.peak_flops / 1e9:,.1f} GFLOP/s"
    lines.append(f"{'prefill':<14} ceiling {r.prefill_tok_s:,.0f} tokens/s (2 x {r.num_params / 1e9:.2f} B FLOPs per "
                 f"token at {peak}): a prompt of {r.context:,} tokens >= "
                 f"{r.context / r.prefill_tok_s * 1e3:,.1f} ms")
    lines.append(f"{'KV transfer':<14} {r.context:,} tokens = {r.context_kv_bytes / 2**30:.2f} GiB: >= "
                 f"{r.transfer_s(link_bytes_per_s) * 1e3:,.1f} ms over {link_bytes_per_s * 8 / 1e9:,.0f} Gbit/s")
    return "\n".join(lines)
