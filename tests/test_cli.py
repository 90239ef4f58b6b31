"""The `pdserve` command as a user runs it: config errors, what generate sends, an unreachable
router, a help line for every option. A running `pdserve serve` (generate, status, scale, SIGHUP,
SIGTERM) is tests/test_serve.py."""

from __future__ import annotations

import argparse
import subprocess
import sys
from concurrent import futures

import grpc
import pytest
import yaml

from cli.main import build_parser
from cli.main import main as pdserve
from client import grpc_client
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from tests.cluster_util import free_port

PDSERVE = [sys.executable, "-m", "cli"]


def _run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*PDSERVE, *args], capture_output=True, text=True, timeout=timeout)


def _in_process(capsys, *args: str) -> tuple[int, str]:
    """`pdserve args` run by the same `main` the console script calls (an exception escaping it
    fails the test): its exit code and what it printed to stderr, without a fresh interpreter's
    start (test_the_real_process_exits_2_with_one_line pays it once)."""
    capsys.readouterr()
    code = pdserve(list(args))
    return code, capsys.readouterr().err


@pytest.mark.parametrize("content, message", [
    ({"prefill": {"replicas": "two"}}, "prefill.replicas: expected an integer, got 'two'"),
    ({"decode": {"replicas": 0}}, "decode.replicas: must be >= 1"),
    ({"routr": {"port": 1}}, "routr: unknown key"),
    ({"kv_cache": {"memory": "lots"}}, "kv_cache.memory: cannot read 'lots' as a size"),
    ({"mode": "sideways"}, "mode: expected one of 'disaggregated', 'colocated', got 'sideways'"),
    ({"router": {"policy": "fastest"}},
     "router.policy: expected one of 'cache_aware', 'load', 'round_robin', got 'fastest'"),
    ({"router": {"decode_policy": 3}}, "router.decode_policy: expected one of 'cache_aware', 'load', 'round_robin' "
                                       "or null, got 3"),
    ({"kv_cache": {"prefix_caching": "yes"}}, "kv_cache.prefix_caching: expected true or false, got 'yes'"),
])
def test_malformed_config_is_one_line_and_exit_2(tmp_path, content, message, capsys):
    bad = tmp_path / "cluster.yaml"
    bad.write_text(yaml.safe_dump(content))
    code, err = _in_process(capsys, "serve", "--config", str(bad))
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in err


def test_the_real_process_exits_2_with_one_line(tmp_path):
    """`python -m cli` as a user runs it: main's code is the process's exit status, the error one
    line on stderr, no traceback."""
    bad = tmp_path / "cluster.yaml"
    bad.write_text(yaml.safe_dump({"decode": {"replicas": 0}}))
    proc = _run("serve", "--config", str(bad))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line == f"pdserve: error: {bad}: decode.replicas: must be >= 1"


def test_the_command_line_starts_without_torch_ray_or_the_router():
    """`pdserve --help`, `status`, `scale` and a config error import only what they use: the
    engine (torch), Ray and the router's serving code load in the commands that run them, not
    for every command (they cost seconds of start-up; `pdserve --help` took 5.5 s with them)."""
    heavy = ("torch", "ray", "transformers", "engine.model_runner", "router.lifecycle.service", "simulate.run")
    code = f"import sys, cli.main; print([m for m in {heavy!r} if m in sys.modules])"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_unparsable_yaml_and_missing_file(tmp_path, capsys):
    bad = tmp_path / "cluster.yaml"
    bad.write_text("mode: [unclosed\n")
    code, err = _in_process(capsys, "serve", "--config", str(bad))
    assert code == 2 and "not valid YAML" in err
    code, err = _in_process(capsys, "serve", "--config", str(tmp_path / "absent.yaml"))
    assert code == 2 and "cannot read" in err


def test_serving_a_model_dir_without_a_checkpoint_says_how_to_make_one(tmp_path, capsys):
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump({"model": {"path": "models/absent"}}))
    code, err = _in_process(capsys, "serve", "--config", str(path))
    assert code == 2 and "Traceback" not in err
    (line,) = err.strip().splitlines()
    assert f"{tmp_path}/models/absent has no config.json" in line and "pdserve convert-gguf --smollm2" in line


@pytest.mark.parametrize("command", ["serve", "generate", "chat", "status", "scale", "role", "convert-gguf"])
def test_every_option_has_a_help_line(command):
    (subcommands,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    parser = subcommands.choices[command]
    assert parser.description or any(c.dest == command and c.help for c in subcommands._choices_actions)
    missing = [a.option_strings or a.dest for a in parser._actions if not a.help]
    assert not missing, f"pdserve {command}: options without help: {missing}"


def test_unreachable_router_is_a_clear_error(capsys, monkeypatch):
    monkeypatch.setattr(grpc_client, "CONNECT_TIMEOUT_S", 0.5)  # nothing listens: no need to wait 5 s
    code, err = _in_process(capsys, "status", "--router", f"127.0.0.1:{free_port()}")
    assert code == 1 and "cannot reach a pdserve router" in err


class _RecordingGeneration(pb_grpc.GenerationServicer):
    """Keeps every request and answers with one finished message."""

    def __init__(self) -> None:
        self.requests: list[pb.GenerateRequest] = []

    def Generate(self, request, context):
        self.requests.append(request)
        yield pb.GenerateResponse(request_id="r", token_ids=[5], text="x", finish_reason="length")


@pytest.mark.parametrize("flags, sent", [
    ([], {}),
    (["--max-tokens", "0", "--top-p", "0", "--seed", "0"], {"max_tokens": 0, "top_p": 0.0, "seed": 0}),
    (["--temperature", "0.5", "--top-k", "3"], {"temperature": 0.5, "top_k": 3}),
])
def test_generate_sends_only_the_sampling_flags_given(flags, sent, capsys):
    servicer = _RecordingGeneration()
    server = grpc.server(futures.ThreadPoolExecutor(2))
    pb_grpc.add_GenerationServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        assert pdserve(["generate", "hi", "--router", f"127.0.0.1:{port}", *flags]) == 0
    finally:
        server.stop(0)
    (request,) = servicer.requests
    assert {f.name: value for f, value in request.sampling.ListFields()} == sent
    assert capsys.readouterr().out == "x\n"


def test_generate_chat_sends_one_user_message_and_no_prompt(capsys):
    servicer = _RecordingGeneration()
    server = grpc.server(futures.ThreadPoolExecutor(2))
    pb_grpc.add_GenerationServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        assert pdserve(["generate", "--chat", "What is the capital of France?", "--router", f"127.0.0.1:{port}"]) == 0
    finally:
        server.stop(0)
    (request,) = servicer.requests
    assert [(m.role, m.content) for m in request.messages] == [("user", "What is the capital of France?")]
    assert request.prompt == "" and not request.prompt_token_ids
    assert capsys.readouterr().out == "x\n"
