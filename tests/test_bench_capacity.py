"""`pdserve bench` checks every generated request against one worker's KV pool before it starts a
cluster (bench/capacity.py): a workload with requests that cannot fit is refused with one line
naming the option that clamps, and clamping cuts exactly those requests to fit."""

from __future__ import annotations

import argparse

import pytest
import yaml

from bench import cli as bench_cli
from bench.capacity import Capacity, fit, worker_capacity
from bench.errors import WorkloadError
from bench.workload import RequestSpec, make_workload
from router.config.loader import parse_config
from tests.cluster_util import kv_bytes


def _bench(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="pdserve")
    bench_cli.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *argv])
    return args.func(args)


def test_the_pool_size_comes_from_num_blocks_or_memory_over_the_block_bytes(llama_dir):
    float32 = {"path": llama_dir, "dtype": "float32"}  # the tiny checkpoint's own dtype (auto: tests/test_sizing.py)
    by_memory = worker_capacity(parse_config({"model": float32, "kv_cache": {"memory": "1MiB"}}))
    assert by_memory == Capacity((1 << 20) // kv_bytes(llama_dir, 16, 16), 16, "kv_cache.memory 1MiB in float32")
    assert worker_capacity(parse_config({"model": {"path": llama_dir}, "kv_cache": {"num_blocks": 7}})) == \
        Capacity(7, 16, "kv_cache.num_blocks 7")
    assert worker_capacity(parse_config({"model": {"path": llama_dir}})) is None  # the device decides


def _workload(*sizes: tuple[int, int]):
    specs = [RequestSpec(f"r{i}", i * 0.1, tuple(range(10, 10 + prompt)), out) for i, (prompt, out) in enumerate(sizes)]
    return make_workload("w", specs, None, {})


def test_misfits_are_refused_in_one_line_or_clamped_to_fit():
    cap = Capacity(4, 16, "kv_cache.num_blocks 4")  # 64 tokens
    workload = _workload((30, 34), (30, 35), (70, 5), (10, 10))
    with pytest.raises(WorkloadError) as refused:
        fit(workload, cap, clamp=False)
    assert str(refused.value) == ("2 of 4 requests need more KV blocks than a worker holds (up to 5; a worker has "
                                  "4, kv_cache.num_blocks 4): give a smaller --input-len or --output-len, or pass "
                                  "--clamp-to-capacity to cut them to fit")
    clamped = fit(workload, cap, clamp=True)
    assert [(s.num_prompt_tokens, s.max_tokens) for s in clamped.requests] == [(30, 34), (30, 34), (63, 1), (10, 10)]
    assert clamped.requests[2].prompt_token_ids == workload.requests[2].prompt_token_ids[:63]
    assert all(cap.blocks_for(s) <= cap.blocks for s in clamped.requests)
    assert clamped.metadata["clamped_to_capacity"] == 2
    assert fit(_workload((30, 34)), cap, clamp=False) == _workload((30, 34))  # all fit: untouched


def test_the_bench_refuses_a_preset_that_does_not_fit_before_starting_a_cluster(llama_dir, tmp_path, capsys):
    """The morning-burst preset against workers of 24 blocks (384 tokens): its long burst prompts
    plus 256 output tokens cannot fit, and the bench says so in one line instead of sending them."""
    config = tmp_path / "cluster.yaml"
    config.write_text(yaml.safe_dump({"model": {"path": llama_dir}, "kv_cache": {"num_blocks": 24}}))
    assert _bench("--config", str(config), "--preset", "morning-burst", "--arrangements", "colocated",
                  "--out", str(tmp_path), "--no-progress") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pdserve bench: ") and "--clamp-to-capacity" in err[0]
    assert "a worker has 24, kv_cache.num_blocks 24" in err[0]
