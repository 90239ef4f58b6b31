"""`pdserve bench --policies`: its flags checked before anything starts (exit 2, one line), the
cluster each policy gets, and a live run of two policies on fresh tiny-model clusters.

The live run replays the shared-prefix preset one request at a time (a closed loop at
concurrency 1), so the ideal hit rate is known by hand: prompts of 64 tokens open with their
group's 48-token prefix (3 blocks of 16), and every request but the first of its group could
reuse those 3 blocks. With two prefill workers the policies differ: cache_aware sends a group
back to the worker that holds its prefix and reaches the ideal; round_robin, in turn, does not.
"""

from __future__ import annotations

import argparse
import json

import pytest

from bench import cli as bench_cli
from bench.arrangements import arrangement_config, policy_config
from cli.main import main as pdserve
from router.config.loader import parse_config

NUM_REQUESTS, INPUT_LEN, PREFIX_LEN, BLOCK_SIZE = 8, 64, 48, 16


def _bench(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="pdserve")
    bench_cli.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *argv])
    return args.func(args)


@pytest.mark.parametrize(("argv", "message"), [
    (["--config", "c.yaml", "--policies", "cache_aware,fifo"],
     "--policies: unknown ['fifo']; choose from cache_aware, load, round_robin"),
    (["--config", "c.yaml", "--policies", "load,load"], "--policies: twice ['load']"),
    (["--config", "c.yaml", "--policies", ","], "--policies: none given"),
    (["--config", "c.yaml", "--policies", "load", "--arrangements", "colocated"],
     "--policies and --arrangements exclude each other"),
    (["--router", "127.0.0.1:1", "--policies", "load"], "--policies needs --config"),
    (["--router", "127.0.0.1:1", "--prefix-caching", "off"], "--prefix-caching needs --config"),
    (["--config", "c.yaml", "--arrangements", "colocated", "--decode-workers", "2"],
     "--decode-workers sizes the --policies clusters"),
])
def test_bad_policy_flags_exit_2_with_one_line(tmp_path, capsys, argv, message):
    assert _bench(*argv, "--out", str(tmp_path)) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pdserve bench: {message}") and err.count("\n") == 1, err
    assert not (tmp_path / "summary.json").exists()


def test_too_few_workers_for_a_disaggregated_cluster_exit_2(llama_dir, tmp_path, capsys):
    config = tmp_path / "cluster.yaml"
    config.write_text(json.dumps({"model": {"path": llama_dir}}))
    assert _bench("--config", str(config), "--policies", "load", "--workers", "1",
                  "--out", str(tmp_path)) == 2
    assert "--policies load: a disaggregated cluster needs at least 1 prefill and 1 decode worker" in \
        capsys.readouterr().err


def test_policy_config_sets_one_policy_for_both_pools_at_the_asked_sizes():
    base = parse_config({"mode": "colocated", "router": {"prefill_policy": "load", "decode_policy": "load"}})
    cfg = policy_config(base, "round_robin", 2, 3, pin_cpus=True)
    assert cfg.mode == "disaggregated"
    assert cfg.router.policy_for("prefill") == cfg.router.policy_for("decode") == "round_robin"
    assert (cfg.prefill.replicas, cfg.decode.replicas) == (2, 3)
    assert (cfg.prefill.cpus, cfg.decode.cpus) == ([0, 1], [2, 3, 4])
    with pytest.raises(ValueError, match="unknown policy 'fifo'"):
        policy_config(base, "fifo", 1, 1)


def test_arrangement_config_splits_the_disaggregated_workers_as_asked():
    base = parse_config({})
    ratios = {p: arrangement_config(base, "disaggregated", 8, pin_cpus=True, prefill_workers=p) for p in (2, 6)}
    assert {p: (c.prefill.replicas, c.decode.replicas) for p, c in ratios.items()} == {2: (2, 6), 6: (6, 2)}
    assert (ratios[2].prefill.cpus, ratios[2].decode.cpus) == ([0, 1], [2, 3, 4, 5, 6, 7])
    assert (arrangement_config(base, "disaggregated", 8).prefill.replicas) == 4  # default: half
    colocated = arrangement_config(base, "colocated", 8, prefill_workers=2)  # no prefill pool to split
    assert (colocated.prefill.replicas, colocated.decode.replicas) == (0, 8)
    with pytest.raises(ValueError, match="8 prefill workers of 8 leave no decode worker"):
        arrangement_config(base, "disaggregated", 8, prefill_workers=8)


@pytest.mark.usefixtures("ray_instance")
def test_policies_replay_the_same_requests_on_fresh_clusters(llama_dir, tmp_path, capsys):
    config = tmp_path / "cluster.yaml"
    config.write_text(json.dumps({"model": {"path": llama_dir}, "router": {"metrics_port": None},
                                  "prefill": {"num_cpus": 0.5}, "decode": {"num_cpus": 0.5},
                                  "kv_cache": {"block_size": BLOCK_SIZE, "num_blocks": 256}}))  # JSON is YAML
    out = tmp_path / "out"
    assert pdserve(["bench", "--config", str(config), "--policies", "cache_aware,round_robin",
                    "--prefill-workers", "2", "--decode-workers", "1", "--prefix-caching", "on",
                    "--preset", "shared-prefix",
                    "--num-requests", str(NUM_REQUESTS), "--input-len", str(INPUT_LEN),
                    "--range-ratio", "0", "--output-len", "4", "--concurrency", "1", "--json",
                    "--out", str(out), "--no-progress"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert list(doc["policies"]) == ["cache_aware", "round_robin"] and "arrangements" not in doc
    assert {k: doc["cluster"][k] for k in ("prefill_workers", "decode_workers", "prefix_caching", "block_size")} \
        == {"prefill_workers": 2, "decode_workers": 1, "prefix_caching": True, "block_size": BLOCK_SIZE}
    assert doc["workload"]["shared_fraction"] == PREFIX_LEN / INPUT_LEN

    lines = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    by_policy = {p: sorted((r["request_id"], r["prompt_tokens"], r["output_tokens"]) for r in lines
                           if r["arrangement"] == p) for p in doc["policies"]}
    assert by_policy["cache_aware"] == by_policy["round_robin"] and len(by_policy["cache_aware"]) == NUM_REQUESTS
    groups = len({request_id.split("-")[0] for request_id, _, _ in by_policy["cache_aware"]})
    ideal = PREFIX_LEN * (NUM_REQUESTS - groups) / (INPUT_LEN * NUM_REQUESTS)
    for name, summary in doc["policies"].items():
        assert summary["num_errors"] == 0 and summary["prompt_tokens"] == NUM_REQUESTS * INPUT_LEN, name
        assert summary["ideal_hit_rate"] == pytest.approx(ideal), name
        assert summary["kv_transfer_bytes"] > 0, name

    assert all("cached_tokens" in r["usage"] for r in lines), [r["usage"] for r in lines]
    for name, summary in doc["policies"].items():
        assert summary["prefill_tokens_computed"] == summary["prompt_tokens"] - sum(
            r["usage"]["cached_tokens"] for r in lines if r["arrangement"] == name), name
    rates = {name: summary["prefix_hit_rate"] for name, summary in doc["policies"].items()}
    # one request at a time, pools that never evict: cache_aware finds every prefix an earlier
    # request left (exactly the ideal); round_robin's turn sends some groups to the other worker
    assert rates["cache_aware"] == pytest.approx(ideal), rates
    assert rates["round_robin"] < ideal - 0.01, rates
