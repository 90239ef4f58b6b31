"""How long one engine step, one KV transfer and one weights load take on an emulated device.

A step reads every weight once and each scheduled request's KV (its whole context, the new
tokens' included), and does 2 FLOPs per parameter per new token plus attention's
4 x layers x heads x head_dim FLOPs per (new token, context token) pair (a sliding-window
layer reads and attends to its last `window` keys only: `ModelShape.sliding_windows`), so on a
device of bandwidth B and peak P it takes at least max(bytes / (B x bandwidth_efficiency),
FLOPs / (P x compute_efficiency)); a fixed `step_overhead_s` (launches, scheduling, sampling)
is added. This is `pdserve plan`'s roofline (bench/roofline.py uses `bytes_read` and
`matmul_flops` from here) applied to the shape of a real step. A transfer takes the emulated
model's KV bytes of the blocks moved over the link plus its latency; a start-up the weights
over the load bandwidth. Pure arithmetic: no clock here (worker_runtime/pacing.py sleeps).
"""

from __future__ import annotations

from dataclasses import dataclass

from sizing.devices import DeviceProfile
from sizing.memory import ModelShape, kv_bytes_per_token


@dataclass(frozen=True)
class StepItem:
    """One request's part of a step: `num_tokens` new tokens ending at position `context`."""

    num_tokens: int
    context: int  # tokens of KV after the step: those before it + num_tokens

    @property
    def is_decode(self) -> bool:
        return self.num_tokens == 1


StepShape = tuple[StepItem, ...]


@dataclass(frozen=True)
class StepTotals:
    """What the cost model needs of a step, summed over its items: a step record carries these
    (protocol/telemetry.py), so a real run's own steps can fit a host's model (bench/calibrate.py)."""

    num_tokens: int
    context_tokens: int  # KV tokens read: every item's context after the step
    attended_pairs: int  # (new token, key) pairs attention computed

    @classmethod
    def of(cls, step: StepShape) -> StepTotals:
        return cls(sum(it.num_tokens for it in step), sum(it.context for it in step),
                   sum(_attended_pairs(it) for it in step))


def bytes_read(weights_bytes: int, kv_per_token: int, contexts: list[int] | tuple[int, ...]) -> int:
    """A step reads every weight once and every request's KV once."""
    return weights_bytes + sum(contexts) * kv_per_token


def matmul_flops(num_params: int, num_tokens: int) -> float:
    """2 FLOPs (a multiply and an add) per parameter per token through the weight matmuls."""
    return 2.0 * num_params * num_tokens


@dataclass(frozen=True)
class CostModel:
    """One model on one device; `dtype_bytes` is the emulated weights' and KV's value size."""

    shape: ModelShape
    device: DeviceProfile
    dtype_bytes: int = 2
    bandwidth_efficiency: float = 1.0
    compute_efficiency: float = 1.0
    step_overhead_s: float = 0.0

    @property
    def weights_bytes(self) -> int:
        return self.shape.num_params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.shape, self.dtype_bytes)

    def step_bytes(self, step: StepShape | StepTotals) -> int:
        if self.shape.sliding_windows and not isinstance(step, StepTotals):
            per_layer_token = self.kv_bytes_per_token // self.shape.num_layers
            return self.weights_bytes + per_layer_token * sum(
                min(it.context, w or it.context) for w in self.shape.sliding_windows for it in step)
        totals = step if isinstance(step, StepTotals) else StepTotals.of(step)
        return bytes_read(self.weights_bytes, self.kv_bytes_per_token, (totals.context_tokens,))

    def step_flops(self, step: StepShape | StepTotals) -> float:
        totals = step if isinstance(step, StepTotals) else StepTotals.of(step)
        flops = matmul_flops(self.shape.num_params, totals.num_tokens)
        heads = self.shape.num_attention_heads
        if heads is None:
            return flops
        per_layer_pair = 4.0 * heads * self.shape.head_dim  # each new token attends to the keys it sees
        if self.shape.sliding_windows and not isinstance(step, StepTotals):
            return flops + per_layer_pair * sum(_attended_pairs(it, w) for w in self.shape.sliding_windows
                                                for it in step)
        return flops + per_layer_pair * self.shape.num_layers * totals.attended_pairs

    def memory_s(self, step: StepShape) -> float:
        return self.step_bytes(step) / (self.device.bandwidth * self.bandwidth_efficiency)

    def compute_s(self, step: StepShape) -> float:
        return self.step_flops(step) / (self.device.flops * self.compute_efficiency)

    def step_s(self, step: StepShape) -> float:
        """The modelled wall time of one step; 0 for an empty one (nothing ran)."""
        if not step:
            return 0.0
        return max(self.memory_s(step), self.compute_s(step)) + self.step_overhead_s


def _attended_pairs(item: StepItem, window: int | None = None) -> int:
    """(query, key) pairs of a causal chunk: token i of n attends to start + i + 1 keys, or to at
    most `window` of them on a sliding-window layer."""
    first, last = item.context - item.num_tokens + 1, item.context  # the new tokens' positions, from 1
    seen = last if window is None else min(last, window)  # positions up to here see all keys before them
    pairs = (first + seen) * (seen - first + 1) // 2 if seen >= first else 0
    return pairs + (window or 0) * max(0, last - max(first - 1, seen))


@dataclass(frozen=True)
class LinkModel:
    """The emulated link between a prefill and a decode worker."""

    bytes_per_s: float
    latency_s: float = 0.0

    def transfer_s(self, num_bytes: int) -> float:
        return self.latency_s + num_bytes / self.bytes_per_s


@dataclass(frozen=True)
class Emulation:
    """What a worker paces by (worker_runtime/pacing.py): the cost model, the link, the load
    bandwidth, and `time_scale`, which stretches every modelled duration."""

    cost: CostModel
    link: LinkModel
    load_bytes_per_s: float
    time_scale: float = 1.0

    @property
    def startup_s(self) -> float:
        """Unscaled seconds to load the emulated weights."""
        return self.cost.weights_bytes / self.load_bytes_per_s

    def assumptions(self) -> str:
        """One line naming every modelled input, printed beside the results they produced."""
        c, d = self.cost, self.cost.device
        return (f"emulated {c.shape.name} on {d.name} ({d.bandwidth / 1e12:g} TB/s x {c.bandwidth_efficiency:g}, "
                f"{d.flops / 1e12:g} TFLOP/s x {c.compute_efficiency:g}, +{c.step_overhead_s * 1e3:g} ms per step), "
                f"link {self.link.bytes_per_s * 8 / 1e9:g} Gbit/s + {self.link.latency_s * 1e6:g} us, "
                f"weights load {self.load_bytes_per_s / 1e9:g} GB/s, time_scale {self.time_scale:g}")
