"""`pdserve serve` as a user runs it, one process for the module (a start of its own Ray and
workers costs 15-20 s here): disaggregated 1 + 1 with TLS and tokens on its gRPC and HTTP ports,
slow steps (faults.step_delay_s) so a stream lasts a few seconds. In order: the CLI as its
client (generate, status, scale), token rotation by SIGHUP, then SIGTERM with an HTTP stream in
flight: serve_forever owns SIGTERM, so the router drains (the stream finishes, /health and new
requests get 503) before the HTTP server stops, the process exits 0, and every process it
started, Ray's included, is gone (other Ray users of the machine are not looked at)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from cli.main import main as pdserve
from engine.kernels import cpu_kernel
from tests.kv_util import wait_until
from tests.process_util import alive as _alive
from tests.process_util import descendants as _descendants
from tests.security_util import ADMIN, ROTATED, TRAFFIC, token_files

PDSERVE = [sys.executable, "-m", "cli"]
pytestmark = pytest.mark.ray  # starts a Ray of its own (conftest: the "own_ray" group)


@dataclass
class Ran:
    returncode: int
    stdout: str
    stderr: str


def _run(capsys, *args: str) -> Ran:
    """The CLI as a client, run by the same `main` the console script calls: a fresh interpreter
    per command costs 10 s or more here, and tests/test_cli.py proves the process's exit status
    is main's."""
    capsys.readouterr()
    code = pdserve(list(args))
    out = capsys.readouterr()
    return Ran(code, out.out, out.err)


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@dataclass
class Serve:
    proc: subprocess.Popen
    address: str  # the gRPC port it bound (config port 0)
    http: str  # https://127.0.0.1:PORT
    traffic: Path  # the traffic token file
    log: Path  # its stderr
    ca: str
    started: dict = field(default_factory=dict)  # every process seen below it

    def look(self) -> None:
        self.started |= _descendants(self.proc.pid)

    def tls(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=self.ca)


@pytest.fixture(scope="module")
def serve(tmp_path_factory, llama_dir, pki):
    d = tmp_path_factory.mktemp("serve")
    token_files(d)
    tls = {"cert_file": os.path.relpath(pki / "server.pem", d), "key_file": os.path.relpath(pki / "server.key", d)}
    config = d / "cluster.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"path": llama_dir}, "prefill": {"num_cpus": 0.5}, "decode": {"num_cpus": 0.5},
        "kv_cache": {"num_blocks": 128}, "faults": {"step_delay_s": 0.02},
        "router": {"port": 0, "http_port": 0, "shutdown_grace_s": 60, "tls": tls,
                   "auth": {"tokens_file": "traffic.txt", "admin_tokens_file": "admin.txt"}}}))
    log = d / "serve.log"
    with log.open("w") as stderr:
        proc = subprocess.Popen([*PDSERVE, "serve", "--config", str(config)], stdout=subprocess.PIPE, stderr=stderr,
                                text=True, start_new_session=True)
    try:
        line = proc.stdout.readline()
        assert "ready in" in line and "; TLS, tokens)" in line, line + log.read_text()[-3000:]
        kernels = cpu_kernel.load()[0]  # each worker's kernels, as the workers load them (torch: they fell back)
        best = kernels.best() if kernels else "torch"
        assert re.search(rf"; CPU kernels: (prefill|decode)-\d+ {best}, (prefill|decode)-\d+ {best}; ", line), line
        address = re.search(r"router listening on (127\.0\.0\.1:\d+) ", line).group(1)
        http = re.search(r"OpenAI API on (https://127\.0\.0\.1:\d+)/v1", line).group(1)
        s = Serve(proc, address, http, d / "traffic.txt", log, str(pki / "ca.pem"))
        s.look()  # what this serve started: Ray's head and workers
        yield s
    finally:
        if proc.poll() is None:  # a test failed before the last one stopped it
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=90)


def test_generate_status_and_scale_from_the_cli(serve, capsys):
    router = ["--router", serve.address, "--ca-file", serve.ca, "--token", ADMIN]
    gen = _run(capsys, "generate", "hello world", "--max-tokens", "8", *router, "--usage")
    assert gen.returncode == 0 and "[length] prompt" in gen.stderr, gen.stderr
    assert "tokens (0 from the prefix cache)" in gen.stderr  # a prompt shorter than one block
    scaled = _run(capsys, "scale", "decode", "2", *router)
    assert scaled.returncode == 0 and "decode pool has 2 workers" in scaled.stdout, scaled.stderr
    status = _run(capsys, "status", *router)
    assert status.returncode == 0
    rows = [line.split()[0] for line in status.stdout.splitlines() if line.startswith(("decode-", "prefill-"))]
    assert sorted(r.split("-")[0] for r in rows) == ["decode", "decode", "prefill"], status.stdout
    serve.look()


def test_serve_rotates_tokens_on_sighup_and_the_cli_speaks_tls(serve, capsys, monkeypatch):
    router = ["--router", serve.address, "--ca-file", serve.ca]
    assert pdserve(["generate", "hi", "--max-tokens", "3", *router, "--token", TRAFFIC]) == 0
    assert pdserve(["generate", "hi", *router]) == 1
    assert "UNAUTHENTICATED: missing or invalid token (give --token or set PDSERVE_TOKEN)" in capsys.readouterr().err
    assert pdserve(["scale", "decode", "1", *router, "--token", TRAFFIC]) == 1
    assert "PERMISSION_DENIED" in capsys.readouterr().err
    assert pdserve(["status", *router]) == 0  # from loopback
    serve.traffic.write_text(f"{ROTATED}\n")
    serve.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: pdserve(["generate", "hi", "--max-tokens", "1", *router, "--token", TRAFFIC]) == 1, 15,
               "the old token to be refused")
    monkeypatch.setenv("PDSERVE_TOKEN", ROTATED)
    assert pdserve(["generate", "hi", "--max-tokens", "3", *router]) == 0
    assert "auth: reloaded 1 traffic and 1 admin tokens" in serve.log.read_text()
    serve.look()


def _get(serve: Serve, path: str, body: dict | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(f"{serve.http}{path}", data=None if body is None else json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {ADMIN}"})
    try:
        with urllib.request.urlopen(request, timeout=30, context=serve.tls()) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_sigterm_drains_http_streams_then_leaves_nothing(serve, capsys):
    status = _run(capsys, "status", "--router", serve.address, "--ca-file", serve.ca)
    workers = sorted(line.split()[0].split("-")[0] for line in status.stdout.splitlines()
                     if line.startswith(("decode-", "prefill-")))
    http_port, grpc_port = int(serve.http.rsplit(":", 1)[1]), int(serve.address.rsplit(":", 1)[1])
    assert _get(serve, "/health") == (200, {"status": "serving"})
    request = urllib.request.Request(f"{serve.http}/v1/completions", data=json.dumps(
        {"prompt": [5, 6, 7], "max_tokens": 150, "stream": True, "ignore_eos": True}).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {ADMIN}"})
    stream = urllib.request.urlopen(request, timeout=60, context=serve.tls())  # 150 slow steps: 3 s or more
    events = [stream.readline()]
    serve.look()
    serve.proc.send_signal(signal.SIGTERM)
    try:
        deadline = time.monotonic() + 10
        while (code := _get(serve, "/health")[0]) == 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert code == 503
        code, body = _get(serve, "/v1/completions", {"prompt": [5], "max_tokens": 2})
        assert code == 503 and "shutting down" in body["error"]["message"]
        events += stream.readlines()
        data = [json.loads(e[6:]) for e in events if e.startswith(b"data: {")]
        assert sum(len(d["choices"][0]["token_ids"]) for d in data) == 150 and b"data: [DONE]\n" in events
    finally:
        returncode = serve.proc.wait(timeout=90)
    assert returncode == 0 and not _port_open(http_port) and not _port_open(grpc_port)
    programs = [cmd.split()[0].rsplit("/", 1)[-1].split(".")[0] for cmd in serve.started.values() if cmd.strip()]
    ray_programs = {"raylet", "gcs_server", "ray::WorkerHost"}  # every pool worker is a WorkerHost (worker_host/)
    assert sorted(p for p in programs if p in ray_programs) == sorted(
        ["gcs_server", "raylet"] + ["ray::WorkerHost" for _ in workers]), programs
    deadline = time.monotonic() + 10
    while _alive(serve.started) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(serve.started), "processes of pdserve serve outlived it"
    with pytest.raises(ProcessLookupError):
        os.killpg(serve.proc.pid, 0)
    text = serve.log.read_text()
    assert not any(token in text for token in (TRAFFIC, ADMIN, ROTATED))  # never a token in a log line
