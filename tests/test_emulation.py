"""Emulated devices: the emulate: section (KV pool sizing, refusals), the fidelity verdict on a real
engine forced to overrun, and a 1 + 1 cluster paced at an emulated device's timings whose tokens
stay exactly transformers' (docs/architecture.md, "Emulation"). The cost model, pacing and
verdict arithmetic: tests/test_emulation_model.py."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest

from bench.emulation import fidelity
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from protocol.sampling import SamplingParams
from router.config.checks import check_host_memory
from router.config.emulate import emulated_num_blocks, emulation
from router.config.typed_yaml import ConfigError
from sizing.cost_model import CostModel, Emulation, LinkModel, StepItem, StepTotals
from sizing.devices import DeviceProfile
from tests.cluster_util import cluster_config
from tests.test_emulation_model import H100, KV_PER_TOKEN, LLAMA_8B, WEIGHTS
from worker_runtime.engine_loop import EngineLoop
from worker_runtime.pacing import Pacer


# ---- the emulate: section -------------------------------------------------------------------
def test_emulation_is_off_by_default_and_sizes_each_pool_like_pdserve_plan(llama_dir):
    off = cluster_config(llama_dir, kv_cache={"num_blocks": None})
    assert emulation(off.emulate) is None and off.engine_config(off.decode).num_blocks is None
    on = cluster_config(llama_dir, kv_cache={"num_blocks": None}, emulate={"device": "h100"})
    # 80 GiB - 16.06 GB of bf16 weights - 8 GiB overhead, in blocks of 16 tokens x 128 KiB
    budget = 80 * 2**30 - WEIGHTS - 8 * 2**30
    assert emulated_num_blocks(on.emulate, 16) == budget // (16 * KV_PER_TOKEN) == 29_205
    assert on.engine_config(on.decode).num_blocks == 29_205
    pinned = cluster_config(llama_dir, kv_cache={"num_blocks": 64}, emulate={"device": "h100"})
    assert pinned.engine_config(pinned.decode).num_blocks == 64  # an explicit pool size wins
    em = emulation(on.emulate)
    assert (em.cost.bandwidth_efficiency, em.cost.compute_efficiency, em.cost.step_overhead_s) == (0.8, 0.6, 0.001)
    assert em.link.bytes_per_s == 50e9 and em.load_bytes_per_s == 5e9
    custom = cluster_config(llama_dir, emulate={"device": "custom", "bandwidth": "100GB/s", "flops": "1TFLOPs",
                                                "memory": "24GiB", "model": "llama-3.2-1b"})
    assert emulation(custom.emulate).cost.device == DeviceProfile("custom", 100e9, 1e12, "24GiB",
                                                                  "emulate: bandwidth, flops, memory")


@pytest.mark.parametrize(("emulate", "message"), [
    ({"device": "h900"}, "emulate: unknown device 'h900'; known: h100, h200, a100, l40s, custom"),
    ({"device": "h100", "time_scale": 0.5}, "emulate.time_scale: must be >= 1"),
    ({"device": "h100", "compute_efficiency": 0}, "emulate.compute_efficiency: must be in (0, 1]"),
    ({"device": "custom", "bandwidth": "1TB/s"}, "emulate: device custom needs bandwidth, flops and memory"),
    ({"device": "h100", "link": "fast"}, "emulate: cannot read 'fast' as link"),
    ({"device": "h100", "model": "gpt-9"}, "emulate: 'gpt-9' is neither a built-in shape"),
    ({"device": "l40s", "model": "llama-3.1-70b"}, "leave no room for one KV block"),
])
def test_a_bad_emulate_section_is_refused_naming_the_key(llama_dir, emulate, message):
    with pytest.raises(ConfigError, match="^cluster.yaml: ") as err:
        cluster_config(llama_dir, emulate=emulate)
    assert message in str(err.value)


def test_pools_beyond_the_host_ram_are_refused_at_load(llama_dir):
    cfg = cluster_config(llama_dir, kv_cache={"num_blocks": None}, emulate={"device": "h100"},
                         decode={"replicas": 3})
    real_per_token = 2 * 2 * 2 * 16 * 4  # the tiny llama: K,V x 2 layers x 2 KV heads x 16 dims x float32
    need = 4 * 29_205 * 16 * real_per_token  # 4 workers' emulated pools of the real model's KV: 957 MB
    check_host_memory(cfg, "cluster.yaml", host_bytes=2 * need)  # half the host: fits exactly
    with pytest.raises(ConfigError, match=r"^cluster.yaml: emulate: 4 workers x 467,280 emulated KV tokens x "
                                          r"512 B per token of the real model need .* of host RAM, over 50% "):
        check_host_memory(cfg, "cluster.yaml", host_bytes=2 * need - 1)


def test_a_real_engine_on_an_absurdly_fast_device_overruns_and_is_marked_not_faithful(llama_dir):
    """No fake clock: the tiny model's real steps on the CPU against a device a million times
    faster than an H100, paced by the engine loop; the tokens are the unpaced engine's."""
    fast = dataclasses.replace(H100, name="absurd", bandwidth=3.35e18, flops=989e18)
    pacer = Pacer(Emulation(CostModel(LLAMA_8B, fast, step_overhead_s=0.0), LinkModel(50e9), 5e9))
    config = EngineConfig(model_path=llama_dir, num_blocks=64, dtype="float32")
    prompts = [list(range(10 + i, 30 + i)) for i in range(3)]
    sampling = SamplingParams(max_tokens=8, ignore_eos=True)
    expected = LLMEngine(config).generate(prompts, sampling)
    got: dict[str, list[int]] = {}
    done = threading.Event()

    def on_outputs(outputs):
        for out in outputs:
            got.setdefault(out.request_id, []).extend(out.token_ids)
            if out.finished and sum(len(v) for v in got.values()) == 24:
                done.set()
    loop = EngineLoop(lambda: LLMEngine(config), on_outputs, pace=pacer.pace)
    try:
        for i, p in enumerate(prompts):
            loop.call(lambda e, i=i, p=p: e.add_request(f"r{i}", prompt_token_ids=p, sampling=sampling)).result(10)
        assert done.wait(60), "the paced engine did not finish"
    finally:
        loop.stop()
    assert [got[f"r{i}"] for i in range(3)] == expected
    stats = pacer.stats()
    assert stats.steps >= 8 and stats.overruns == stats.steps  # every real step outlasts a ~1 ns model
    verdict = fidelity({"decode-0": ("decode", stats)})
    assert not verdict["faithful"] and verdict["suggested_time_scale"] > 1000


def test_a_paced_steps_record_and_its_prompts_compute_time_are_the_emulated_steps(llama_dir):
    """The pacing runs inside the step, before it is recorded: the step records the bench reads
    and the first token's prefill compute time carry the emulated step time, not the host's."""
    slow = dataclasses.replace(H100, name="slow", bandwidth=16e9 / 0.08)  # Llama-8B's 16 GB: >= 80 ms a step
    pacer = Pacer(Emulation(CostModel(LLAMA_8B, slow, step_overhead_s=0.0), LinkModel(50e9), 5e9))
    outputs, done = [], threading.Event()

    def on_outputs(outs):
        outputs.extend(outs)
        if any(o.finished for o in outs):
            done.set()
    engine = LLMEngine(EngineConfig(model_path=llama_dir, num_blocks=64, dtype="float32"))
    loop = EngineLoop(lambda: engine, on_outputs, pace=pacer.pace)
    try:
        sampling = SamplingParams(max_tokens=3, ignore_eos=True)
        loop.call(lambda e: e.add_request("r", prompt_token_ids=list(range(10, 30)), sampling=sampling)).result(10)
        assert done.wait(60), "the paced engine did not finish"
        records = loop.call(lambda e: e.telemetry.since(0)).result(10)
    finally:
        loop.stop()
    assert len(records) == 3 and pacer.stats().steps == 3  # the prefill and two decode steps
    assert all(r.wall_s >= 0.08 for r in records), [r.wall_s for r in records]
    first = next(o for o in outputs if o.prefill_timing is not None)
    assert first.prefill_timing.compute_s >= 0.08


def test_the_host_work_between_busy_steps_counts_against_the_next_steps_model(llama_dir):
    """A busy loop times each step from the end of the previous one's pacing, so the outputs'
    handling (here 0.2 s of it) lands inside the next step's modelled time instead of after it."""
    host_work_s, paced, handled = 0.2, [], []

    def pace(engine, began):
        paced.append((began, time.perf_counter()))

    def on_outputs(outs) -> None:
        handled.append(time.perf_counter())  # the host work of these outputs begins
        time.sleep(host_work_s)
        if any(o.finished for o in outs):
            done.set()

    done = threading.Event()
    loop = EngineLoop(lambda: LLMEngine(EngineConfig(model_path=llama_dir, num_blocks=64, dtype="float32")),
                      on_outputs, pace=pace)
    try:
        sampling = SamplingParams(max_tokens=3, ignore_eos=True)
        loop.call(lambda e: e.add_request("r", prompt_token_ids=list(range(10, 30)), sampling=sampling)).result(10)
        assert done.wait(60), "the loop did not finish"
    finally:
        loop.stop()
    assert len(paced) == 3  # the prefill and two decode steps
    # each next step is timed from before the previous outputs' host work began (events, no bound)
    for (_, previous_end), work_began, (began, end) in zip(paced, handled, paced[1:], strict=False):
        assert previous_end <= began <= work_began and end - began >= host_work_s


# ---- a cluster at emulated timings -------------------------------------------------------------
@pytest.fixture(scope="module")
def emulated(ray_instance, llama_dir):
    """1 + 1 workers at the timings of Llama-3.2-1B on a slow emulated device (100 GB/s: a decode
    step of ~25 ms; a 1 Gbit/s link with 10 ms latency: a visible KV transfer), each pool the size
    the device leaves (4 GiB - 2.5 GB weights - 1 GiB: 1,429 blocks)."""
    from router.launch import LocalCluster

    cfg = cluster_config(llama_dir, kv_cache={"num_blocks": None}, emulate={
        "device": "custom", "bandwidth": "100GB/s", "flops": "10TFLOPs", "memory": "4GiB",
        "model": "llama-3.2-1b", "overhead": "1GiB", "bandwidth_efficiency": 1.0, "compute_efficiency": 1.0,
        "step_overhead_s": 0.0, "link": "1Gbit", "link_latency_s": 0.01, "load_bandwidth": "100GB/s"})
    with LocalCluster(cfg) as cluster:
        yield cluster


def test_an_emulated_cluster_gives_transformers_tokens_at_the_modelled_pace(emulated, llama_dir):
    from tests.cluster_util import Client
    from tests.reference import hf_greedy

    client = Client(emulated.address)
    prompts = [list(range(20 + i, 50 + i)) for i in range(2)]
    try:
        started = time.perf_counter()
        got = client.many(prompts, max_tokens=6, ignore_eos=True)
        elapsed = time.perf_counter() - started
        alone, last = client.tokens(list(range(60, 90)), max_tokens=2, ignore_eos=True)
    finally:
        client.close()
    assert got == [hf_greedy(llama_dir, p, 6, ignore_eos=True) for p in prompts]
    assert alone == hf_greedy(llama_dir, list(range(60, 90)), 2, ignore_eos=True)
    # its KV (29 tokens: 2 blocks of 16 x 32 KiB per token) crossed the emulated link: 10 ms + 1 MiB at 125 MB/s
    assert last.usage.kv_transfer_ms >= (0.01 + 2 * 16 * 32_768 / 125e6) * 1e3
    workers = {w.name: w for w in emulated.router.pools.all()}
    stats = {name: emulated.call(_within(w.actor.emulation.remote())) for name, w in workers.items()}
    decode = next(s for name, s in stats.items() if name.startswith("decode"))
    prefill = next(s for name, s in stats.items() if name.startswith("prefill"))
    # llama-3.2-1b bf16 weights, 2,471,628,800 bytes, read once per step at 100 GB/s: >= 24.7 ms a step
    per_step = 1_235_814_400 * 2 / 100e9
    assert prefill.steps >= 1 and decode.steps >= 5  # every decoding token after the first is a paced step
    assert decode.modelled_s >= decode.steps * per_step
    assert decode.transfers >= 3  # one per request at least, counted where the KV landed
    assert elapsed >= 5 * per_step  # each request's 5 decode steps at least
    info = {w.info.pool: w.info.num_blocks for w in workers.values()}
    kv_per_token = 2 * 16 * 8 * 64 * 2  # llama-3.2-1b: K,V x 16 layers x 8 KV heads x 64 x bf16
    budget = 4 * 2**30 - 1_235_814_400 * 2 - 2**30
    assert info == {"prefill": budget // (16 * kv_per_token), "decode": budget // (16 * kv_per_token)} == {
        "prefill": 1_429, "decode": 1_429}


def _within(ref):
    from protocol.deadline import within

    return within(ref, 30)


# ---- pdserve bench --emulate -----------------------------------------------------------------
def _bench(*argv: str) -> int:
    import argparse

    from bench import cli as bench_cli

    parser = argparse.ArgumentParser(prog="pdserve")
    bench_cli.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *argv])
    return args.func(args)


@pytest.mark.parametrize(("argv", "message"), [
    (["--router", "127.0.0.1:1", "--emulate", "h100:llama-3.1-8b"], "--emulate needs --config"),
    (["--config", "c.yaml", "--emulate-time-scale", "2"], "--emulate-time-scale needs --emulate"),
    (["--config", "{config}", "--emulate", "h100"], "--emulate 'h100': expected DEVICE:MODEL"),
    # 4,096 pools of 467,280 tokens x 512 B of the tiny llama's KV: 980 GB, over half of any host here
    (["--config", "{config}", "--emulate", "h100:llama-3.1-8b", "--workers", "4096"],
     "--arrangements colocated: emulate: 4096 workers x 467,280 emulated KV tokens"),
])
def test_bad_emulate_flags_exit_2_with_one_line(llama_dir, tmp_path, capsys, argv, message):
    config = tmp_path / "cluster.yaml"
    config.write_text(f'{{"model": {{"path": "{llama_dir}"}}, "kv_cache": {{"block_size": 16}}}}')
    argv = [a.replace("{config}", str(config)) for a in argv]
    assert _bench(*argv, "--out", str(tmp_path / "out")) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pdserve bench: {message}") and err.count("\n") == 1, err


@pytest.mark.usefixtures("ray_instance")
def test_bench_emulates_h100_timings_and_reports_its_fidelity(llama_dir, tmp_path, capsys):
    import json

    from cli.main import main as pdserve

    config = tmp_path / "cluster.yaml"
    config.write_text(json.dumps({"model": {"path": llama_dir}, "router": {"metrics_port": None},
                                  "prefill": {"num_cpus": 0.5}, "decode": {"num_cpus": 0.5},
                                  "kv_cache": {"block_size": 16}, "emulate": {"load_bandwidth": "100GB/s"}}))
    assert pdserve(["bench", "--config", str(config), "--emulate", "h100:llama-3.1-8b", "--emulate-time-scale", "2",
                    "--arrangements", "disaggregated", "--workers", "2", "--num-requests", "4", "--input-len", "32",
                    "--range-ratio", "0", "--output-len", "6", "--concurrency", "2", "--json",
                    "--out", str(tmp_path / "out"), "--no-progress"]) == 0
    run = json.loads(capsys.readouterr().out)["arrangements"]["disaggregated"]
    assert run["num_errors"] == 0
    f = run["emulation"]
    assert f["assumptions"].startswith("emulated llama-3.1-8b on h100 (3.35 TB/s x 0.8, 989 TFLOP/s x 0.6, +1 ms")
    assert f["assumptions"].endswith("time_scale 2")
    assert f["time_scale"] == 2 and set(f["pools"]) == {"prefill", "decode", "kv_transfer"}
    # 4 requests x 5 decode rows, at most 2 to a step, and 4 prompts, at most 2 to a step
    assert f["pools"]["decode"]["steps"] >= 10 and f["pools"]["prefill"]["steps"] >= 2
    assert f["transfers"] >= 4 and f["pools"]["kv_transfer"]["steps"] == f["transfers"]
    assert 0 <= f["overruns"] <= f["steps"]
    assert f["faithful"] == (f["overrun_share"] <= 0.01 and f["transfer_overrun_share"] <= 0.01)
    assert (f["suggested_time_scale"] is None) == f["faithful"]
    # reported in emulated time: a decode step at ~40 tokens of context is >= 16.07 GB / (3.35 TB/s x 0.8)
    # + 1 ms = 6.99 ms; paced at x 2, divided back by 2. The mean gap, not a percentile: a client
    # that falls behind on a loaded host reads two messages back to back (one gap near 0, the
    # next twice as long), which moves the percentiles but not a request's first-to-last time
    assert run["itl_ms"]["mean"] >= 6.99


def test_the_host_fit_recovers_a_known_cost_model(llama_dir):
    """Steps timed by a known host (2 GB/s reads, 40 GFLOP/s, 3 ms a step): the fit, given the
    bandwidth, finds the FLOP/s and the overhead again."""
    from pathlib import Path

    from bench.calibrate import fit
    from router.config.emulate import emulated_shape

    host = CostModel(emulated_shape(llama_dir), DeviceProfile("host", 2e9, 40e9, "8GiB", ""), dtype_bytes=4)
    shapes = [tuple(StepItem(1, 17 + i) for _ in range(b)) for b in (1, 2, 4, 8) for i in range(3)]
    shapes += [(StepItem(n, n),) for n in (32, 64, 128, 256)]
    measured = [(StepTotals.of(s), host.memory_s(s) + host.compute_s(s) + 0.003) for s in shapes]
    found = fit(Path(llama_dir), "float32", measured, bandwidth=2e9)
    assert found.flops == pytest.approx(40e9, rel=1e-6) and found.overhead_s == pytest.approx(0.003, rel=1e-6)
    assert found.rms_error_s < 1e-9 and found.steps == len(shapes)
    assert found.emulate_section(llama_dir, "float32")["flops"] == "4e+10"


def test_a_step_record_carries_what_the_cost_model_needs_and_a_run_fits_from_its_records(llama_dir):
    """Each engine step records its KV read and attention pairs, so a real run's own steps fit a
    host's model (bench/emulation_check.py --fit run). Exact for one known step: two requests of
    5 and 9 prompt tokens prefilled together (pairs 5*6/2 + 9*10/2), then decoded once (contexts 6
    and 10). Records fit as their shapes do: the model's bytes and FLOPs of both are identical."""
    from bench.calibrate import from_records
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from protocol.sampling import SamplingParams
    from router.config.emulate import emulated_shape

    engine = LLMEngine(EngineConfig(model_path=llama_dir, num_blocks=64, dtype="float32"))
    shapes = []
    for i, n in enumerate((5, 9)):
        engine.add_request(f"r{i}", prompt_token_ids=list(range(20, 20 + n)),
                           sampling=SamplingParams(max_tokens=2, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
        shapes.append(engine.last_step)
    prefill, decode = engine.telemetry.since(0)
    assert (prefill.prefill_tokens, prefill.context_tokens, prefill.attended_pairs) == (14, 14, 15 + 45)
    assert (decode.decode_rows, decode.context_tokens, decode.attended_pairs) == (2, 16, 16)
    unit = CostModel(emulated_shape(llama_dir), DeviceProfile("unit", 1.0, 1.0, "1B", ""), dtype_bytes=4)
    for (totals, wall), shape, record in zip(from_records([prefill, decode]), shapes, (prefill, decode), strict=True):
        assert wall == record.wall_s
        assert (unit.step_bytes(totals), unit.step_flops(totals)) == (unit.step_bytes(shape), unit.step_flops(shape))
