"""`pdserve bench --report page.html --cost-per-worker-hour X` against a router double whose usage
carries the TTFT split and token kinds: summary.json's bottleneck and decision, one self-contained
page; then a real headless browser (Chromium, Debian's `chromium-headless-shell` or `chromium`)
loads the page and a screenshot must show its tables and its charts."""

from __future__ import annotations

import html.parser
import json
import shutil
import subprocess
import time
from concurrent import futures

import grpc
import pytest

from cli.main import main as pdserve
from proto import pdserve_pb2, pdserve_pb2_grpc

BROWSERS = ("chromium-headless-shell", "chromium", "chromium-browser", "google-chrome")
HEADER_RGB = (220, 230, 243)  # the tables' header background (#dce6f3)
RECOMMENDATION_RGB = (233, 245, 236)  # the recommendation box (#e9f5ec)
CHART_RGB = (31, 119, 180)  # matplotlib's tab:blue: only the embedded charts draw it


class _Generation(pdserve_pb2_grpc.GenerationServicer):
    """One token per message, the first after 60 ms (17 of them accounted for by the server's
    timings); every fifth gap 60 ms after a step that "ran prefill", else 3 ms."""

    def Generate(self, request, context):
        n = request.sampling.max_tokens
        kinds = "F" + "".join("I" if i % 5 == 0 else "D" for i in range(1, n))
        time.sleep(0.06)
        for i in range(n):
            if i:
                time.sleep(0.06 if kinds[i] == "I" else 0.003)
            usage = None
            if i == n - 1:
                usage = pdserve_pb2.Usage(prompt_tokens=8, completion_tokens=n, ttft_ms=20, kv_wait_ms=1,
                                          prefill_queue_ms=4, prefill_compute_ms=12, token_steps=kinds)
            yield pdserve_pb2.GenerateResponse(token_ids=[7], finish_reason="length" if usage else "", usage=usage)


class _Admin(pdserve_pb2_grpc.AdminServicer):
    def Status(self, request, context):
        return pdserve_pb2.StatusResponse(mode="colocated", workers=[pdserve_pb2.WorkerStatus(name=f"w{i}")
                                                                      for i in range(2)])


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    pdserve_pb2_grpc.add_GenerationServicer_to_server(_Generation(), server)
    pdserve_pb2_grpc.add_AdminServicer_to_server(_Admin(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    out = tmp_path_factory.mktemp("bench")
    try:
        code = pdserve(["bench", "--router", f"127.0.0.1:{port}", "--num-requests", "8", "--rate", "40",
                        "--input-len", "8", "--output-len", "16", "--slo", "ttft=1,tpot=100ms",
                        "--cost-per-worker-hour", "3.6", "--out", str(out), "--report", str(out / "page.html"),
                        "--no-progress"])
    finally:
        server.stop(None).wait(5)
    assert code == 0
    return out


def test_summary_names_the_limit_and_prices_the_run(report):
    doc = json.loads((report / "summary.json").read_text())
    found = doc["arrangements"]["router"]["bottleneck"]
    assert found["itl_p99"]["limit"] == "interference" and found["itl_p99"]["shares"]["interference"] >= 0.8
    assert found["ttft_p99"]["limit"] == "transfer"  # 17 of the 60+ ms are accounted for; the rest is hops
    row = doc["decision"]["ranking"][0]
    assert row["workers"] == 2 and row["tok_per_worker_s"] == pytest.approx(row["output_tok_per_s"] / 2)
    assert row["usd_per_million_tokens"] == pytest.approx(3.6 * 2 / 3600 / row["output_tok_per_s"] * 1e6)
    assert doc["decision"]["recommendation"].startswith("Measured router at 2 workers each: 100% of requests")


class _Counter(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: dict[str, int] = {}
        self.sources: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags[tag] = self.tags.get(tag, 0) + 1
        self.sources += [value for key, value in attrs if tag == "img" and key == "src"]


def test_the_page_is_self_contained(report):
    page = _Counter()
    page.feed((report / "page.html").read_text())
    assert page.tags["h1"] == 1 and page.tags["table"] == 4  # ranking, limits, latency, workload
    assert len(page.sources) == 4 and all(src.startswith("data:image/png;base64,") for src in page.sources)
    assert "script" not in page.tags and "link" not in page.tags


def _browser() -> str | None:
    return next((path for name in BROWSERS if (path := shutil.which(name))), None)


@pytest.mark.slow
@pytest.mark.skipif(_browser() is None, reason="no Chromium: apt-get install chromium-headless-shell "
                                               "(scripts/setup.sh test does it where it can)")
def test_a_headless_browser_renders_the_tables_and_charts(report, tmp_path):
    from PIL import Image

    shot = tmp_path / "page.png"
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", f"--user-data-dir={tmp_path / 'p'}"]
    url = (report / "page.html").resolve().as_uri()
    dom = subprocess.run([_browser(), *flags, "--dump-dom", url], capture_output=True, text=True, timeout=90)
    parsed = _Counter()
    parsed.feed(dom.stdout)
    assert parsed.tags.get("table") == 4 and parsed.tags.get("img") == 4, dom.stderr[-2000:]
    subprocess.run([_browser(), *flags, f"--screenshot={shot}", "--window-size=1200,4000", url],
                   capture_output=True, timeout=90, check=True)
    pixels = Image.open(shot).convert("RGB")
    counts = {rgb: 0 for rgb in (HEADER_RGB, RECOMMENDATION_RGB, CHART_RGB)}
    for count, rgb in pixels.getcolors(maxcolors=1 << 24):
        if rgb in counts:
            counts[rgb] += count
    assert pixels.size == (1200, 4000)
    assert counts[HEADER_RGB] > 2000, "no table header was painted"
    assert counts[RECOMMENDATION_RGB] > 20_000, "the recommendation box was not painted"
    assert counts[CHART_RGB] > 500, "no chart was painted (the embedded PNGs did not decode)"
