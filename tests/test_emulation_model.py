"""Emulated devices' arithmetic: the cost model against step times computed by hand, the pacing
arithmetic, the bench's time dilation and fidelity verdict, and the emulated link's hold
(docs/architecture.md, "Emulation"). The emulate: section, real engines and a cluster at emulated
timings: tests/test_emulation.py."""
from __future__ import annotations

import dataclasses
import time

import pytest

from bench.emulation import contract_records, dilate, fidelity, format_fidelity, parse_emulate
from bench.errors import BenchError
from bench.metrics import RequestRecord
from bench.workload import RequestSpec, Workload
from kv_transfer import LinkPace
from protocol.telemetry import EmulationStats
from router.config.emulate import link_pace
from sizing.cost_model import CostModel, Emulation, LinkModel, StepItem
from sizing.devices import DEVICES
from sizing.memory import BUILTIN_SHAPES
from worker_runtime.pacing import Pacer

LLAMA_8B = BUILTIN_SHAPES["llama-3.1-8b"]  # 32 layers, 32 query / 8 KV heads of 128, 8,030,261,248 params
H100 = DEVICES["h100"]  # 3.35e12 B/s, 989e12 FLOP/s
WEIGHTS = 8_030_261_248 * 2  # bf16: 16,060,522,496 bytes
KV_PER_TOKEN = 2 * 32 * 8 * 128 * 2  # K and V x layers x KV heads x head_dim x 2 bytes = 131,072
ATTENTION_PER_PAIR = 4 * 32 * 32 * 128  # QK^T and AV, 2 FLOPs each, x layers x query heads x head_dim


# ---- the cost model against hand-computed step times ------------------------------------------
def test_a_decode_step_is_memory_bound_weights_plus_kv_over_bandwidth():
    cost = CostModel(LLAMA_8B, H100)
    step = (StepItem(1, 1024),)  # one decode row whose context is 1,024 tokens after the step
    read = WEIGHTS + 1024 * KV_PER_TOKEN  # 16,194,740,224 bytes
    flops = 2 * 8_030_261_248 * 1 + ATTENTION_PER_PAIR * 1024  # the new token attends to 1,024 keys
    assert cost.step_bytes(step) == read
    assert cost.step_flops(step) == flops
    assert cost.step_s(step) == pytest.approx(read / 3.35e12)  # 4.834 ms, memory-bound
    assert cost.step_s(step) == pytest.approx(4.8342e-3, rel=1e-4)


def test_a_prefill_chunk_is_compute_bound_weights_and_causal_attention():
    cost = CostModel(LLAMA_8B, H100)
    step = (StepItem(2048, 2048),)  # a 2,048-token prompt from nothing
    pairs = 2048 * 2049 // 2  # token i attends to i + 1 keys
    flops = 2 * 8_030_261_248 * 2048 + ATTENTION_PER_PAIR * pairs  # 33,991,998,570,496
    assert cost.step_flops(step) == flops
    assert cost.step_s(step) == pytest.approx(flops / 989e12)  # 34.37 ms, compute-bound
    assert cost.step_s(step) == pytest.approx(34.370e-3, rel=1e-4)


def test_a_mixed_step_with_efficiencies_and_overhead():
    cost = CostModel(LLAMA_8B, H100, bandwidth_efficiency=0.8, compute_efficiency=0.5, step_overhead_s=0.001)
    # four decodes at 1,000 tokens of context, one chunk of 256 tokens after 256 already computed
    step = tuple(StepItem(1, 1000) for _ in range(4)) + (StepItem(256, 512),)
    read = WEIGHTS + (4 * 1000 + 512) * KV_PER_TOKEN
    pairs = 4 * 1000 + (256 * 256 + 256 * 257 // 2)  # the chunk: 256 earlier keys each, plus its causal part
    flops = 2 * 8_030_261_248 * (4 + 256) + ATTENTION_PER_PAIR * pairs
    memory_s, compute_s = read / (3.35e12 * 0.8), flops / (989e12 * 0.5)
    assert compute_s > memory_s  # 260 tokens: past the compute-bound batch at half the peak
    assert cost.step_s(step) == pytest.approx(compute_s + 0.001)
    assert cost.step_s(()) == 0.0  # a step that computed nothing is not paced


def test_a_kv_transfer_and_a_start_up_take_bytes_over_their_bandwidth():
    em = Emulation(CostModel(LLAMA_8B, H100), LinkModel(400e9 / 8, 50e-6), load_bytes_per_s=5e9, time_scale=2)
    pace = link_pace(em, block_size=16)
    assert pace == LinkPace(16 * KV_PER_TOKEN, 50e9, 50e-6, 2)
    # an 8k prompt's KV: 512 blocks of 2 MiB over 400 Gbit/s, plus the latency, stretched x 2
    assert pace.seconds(512) == pytest.approx((50e-6 + 512 * 16 * KV_PER_TOKEN / 50e9) * 2)
    assert pace.seconds(512) == pytest.approx(2 * 21.525e-3, rel=1e-3)
    assert em.startup_s == pytest.approx(WEIGHTS / 5e9)  # 3.2 s, unscaled


# ---- pacing arithmetic --------------------------------------------------------------------
class FakeClock:
    def __init__(self):
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def _emulation(time_scale: float = 1.0, overhead_s: float = 0.0) -> Emulation:
    return Emulation(CostModel(LLAMA_8B, H100, step_overhead_s=overhead_s), LinkModel(50e9), 5e9, time_scale)


def test_a_step_is_padded_to_its_modelled_time_times_the_scale():
    clock = FakeClock()
    pacer = Pacer(_emulation(time_scale=3), clock, clock.sleep)
    step = (StepItem(1, 1024),)
    modelled = (WEIGHTS + 1024 * KV_PER_TOKEN) / 3.35e12  # 4.834 ms
    began = clock.now
    clock.now += 0.002  # the real step took 2 ms
    assert pacer.pace_step(step, began) == pytest.approx(3 * modelled - 0.002)
    assert clock.now - began == pytest.approx(3 * modelled)  # the step ends when the scaled model says
    s = pacer.stats()
    assert (s.steps, s.overruns, s.lateness_s) == (1, 0, 0.0)
    assert s.real_s == pytest.approx(0.002) and s.modelled_s == pytest.approx(modelled)


def test_a_step_slower_than_its_model_overruns_and_is_late_by_the_difference():
    clock = FakeClock()
    pacer = Pacer(_emulation(time_scale=2), clock, clock.sleep)
    step = (StepItem(1, 1024),)
    modelled = (WEIGHTS + 1024 * KV_PER_TOKEN) / 3.35e12
    for real in (0.030, 0.005, 0.020):  # 30 ms and 20 ms outlast 2 x 4.83 ms; 5 ms does not
        began = clock.now
        clock.now += real
        pacer.pace_step(step, began)
    s = pacer.stats()
    assert (s.steps, s.overruns) == (3, 2)
    assert s.lateness_s == pytest.approx((0.030 - 2 * modelled) + (0.020 - 2 * modelled))
    assert s.max_lateness_s == pytest.approx(0.030 - 2 * modelled)
    assert clock.slept == [pytest.approx(2 * modelled - 0.005)]  # only the fast step slept
    ratios = sorted(r / modelled for r in (0.030, 0.005, 0.020))
    assert s.ratio_p99 == pytest.approx(ratios[1] + 0.98 * (ratios[2] - ratios[1]))  # numpy's linear p99
    assert s.overrun_share == pytest.approx(2 / 3)


def test_start_up_waits_out_the_emulated_weights_load():
    clock = FakeClock()
    pacer = Pacer(_emulation(time_scale=2), clock, clock.sleep)
    began = clock.now
    clock.now += 1.0  # loading the real model took 1 s
    assert pacer.wait_startup(began) == pytest.approx(2 * WEIGHTS / 5e9 - 1.0)
    assert clock.now - began == pytest.approx(2 * WEIGHTS / 5e9)


# ---- bench: time dilation and the verdict ---------------------------------------------------------
def test_bench_stretches_arrivals_and_divides_durations_back():
    workload = Workload("w", (RequestSpec("a", 0.5, (1, 2), 4), RequestSpec("b", 2.0, (3,), 4)))
    assert [r.arrival_s for r in dilate(workload, 4).requests] == [2.0, 8.0]
    record = RequestRecord("a", "run", 2.0, (2.4, 2.8), (1, 1), 2, 2, "length", None,
                           {"kv_wait_ms": 40.0, "token_steps": "FD", "cached_tokens": 0})
    back = contract_records([record], 4)[0]
    assert (back.send_s, back.message_times_s) == (0.5, (0.6, 0.7))
    assert back.usage == {"kv_wait_ms": 10.0, "token_steps": "FD", "cached_tokens": 0}
    assert parse_emulate("h100:llama-3.1-8b") == ("h100", "llama-3.1-8b")
    with pytest.raises(BenchError, match="expected DEVICE:MODEL"):
        parse_emulate("h100")


def _stats(steps: int, overruns: int, ratio_p99: float, late_s: float = 0.0) -> EmulationStats:
    return EmulationStats(2.0, steps, overruns, 0.0, 0.0, late_s, late_s, ratio_p99, 3.2)


def test_a_run_with_more_than_one_percent_overruns_is_not_faithful():
    good = fidelity({"prefill-0": ("prefill", _stats(500, 5, 1.5)), "decode-1": ("decode", _stats(500, 5, 1.9))})
    assert good["faithful"] and good["overrun_share"] == 0.01 and good["suggested_time_scale"] is None
    bad = fidelity({"prefill-0": ("prefill", _stats(500, 5, 1.5)),
                    "decode-1": ("decode", _stats(500, 6, 3.01, late_s=0.4))})
    assert not bad["faithful"] and bad["overrun_share"] == pytest.approx(0.011)
    assert bad["suggested_time_scale"] == 3.1  # covers 99% of the slowest worker's steps
    assert bad["pools"]["decode"]["lateness_ms"] == pytest.approx(200.0)  # 0.4 s at time_scale 2: emulated ms
    assert format_fidelity("disaggregated", bad).endswith("NOT faithful: rerun with time_scale 3.1")
    slow_link = fidelity({"decode-1": ("decode", dataclasses.replace(
        _stats(500, 0, 1.2), transfers=50, transfer_overruns=2, transfer_lateness_s=0.2, transfer_ratio_max=5.55))})
    assert slow_link["overrun_share"] == 0 and slow_link["transfer_overrun_share"] == 0.04
    assert not slow_link["faithful"] and slow_link["suggested_time_scale"] == 5.6  # the slowest transfer fits
    assert slow_link["pools"]["kv_transfer"] == {"steps": 50, "overruns": 2, "lateness_ms": pytest.approx(100.0),
                                                 "max_lateness_ms": 0.0}


def test_the_receiver_holds_a_transfer_to_the_emulated_link_and_counts_late_ones():
    from kv_transfer.pace import LinkClock

    clock = LinkClock(LinkPace(block_bytes=1_000_000, bytes_per_s=100e6, latency_s=0.01, time_scale=2))
    header_at = time.monotonic()
    clock.hold(2, header_at)  # (10 ms + 2 MB at 100 MB/s) x 2 = 60 ms after the header
    assert time.monotonic() - header_at >= 0.060
    clock.hold(1, time.monotonic() - 0.5)  # landed 0.5 s after its header: 0.5 - 0.04 late
    s = clock.stats()
    assert (s.transfers, s.overruns) == (2, 1)
    assert s.lateness_s == pytest.approx(0.46, abs=0.01) and s.ratio_max == pytest.approx(0.5 / 0.02, rel=0.02)
    LinkClock(None).hold(100, time.monotonic() - 1)  # no emulated link: nothing held, nothing counted
