"""Router Prometheus metrics, scraped over HTTP the way Prometheus does; the request log's lines."""

from __future__ import annotations

import asyncio
import io
import json
import socket
import ssl
import threading
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from protocol.outputs import FinishReason
from protocol.sampling import SamplingParams
from protocol.usage import Usage
from router.frontdoor.access import Gate
from router.frontdoor.guards import Refusals
from router.lifecycle.admission import Admission
from router.lifecycle.life import RequestLife
from router.observability.metrics import RouterMetrics
from router.observability.metrics_server import ConnectionLimits, start_metrics_server
from router.observability.request_log import RequestLog


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


@pytest.fixture
def served():
    metrics = RouterMetrics()
    server = start_metrics_server(metrics.registry, "127.0.0.1", 0, Gate(), Refusals())
    yield metrics, f"http://127.0.0.1:{server.port}/metrics"
    server.close()


def _scrape(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as response:
        assert response.status == 200
        return _samples(response.read().decode())


def test_request_latencies_and_counters_are_scraped(served):
    metrics, url = served
    metrics.observe_queue(0.002)
    metrics.observe_prefill(0.3)
    metrics.observe_kv_transfer(0.004, 2 * 1024 * 1024)
    metrics.observe_first_token(0.31)
    metrics.observe_first_token(1.7)
    for gap in (0.02, 0.03, 0.0):
        metrics.observe_token(gap)
    metrics.observe_finish(FinishReason.LENGTH, 2.5)  # labelled with its text
    metrics.observe_error("RESOURCE_EXHAUSTED")
    samples = _scrape(url)
    assert samples[("pdserve_ttft_seconds_count", ())] == 2
    assert samples[("pdserve_ttft_seconds_sum", ())] == pytest.approx(2.01)
    assert samples[("pdserve_ttft_seconds_bucket", (("le", "0.5"),))] == 1
    assert samples[("pdserve_ttft_seconds_bucket", (("le", "+Inf"),))] == 2
    assert samples[("pdserve_itl_seconds_count", ())] == 3
    assert samples[("pdserve_itl_seconds_bucket", (("le", "0.02"),))] == 2
    assert samples[("pdserve_e2e_seconds_count", ())] == 1
    assert samples[("pdserve_queue_seconds_count", ())] == 1
    assert samples[("pdserve_prefill_seconds_sum", ())] == pytest.approx(0.3)
    assert samples[("pdserve_kv_transfer_seconds_count", ())] == 1
    assert samples[("pdserve_kv_transfer_bytes_sum", ())] == 2 * 1024 * 1024
    assert samples[("pdserve_requests_total", (("finish_reason", "length"),))] == 1
    assert samples[("pdserve_request_errors_total", (("status", "RESOURCE_EXHAUSTED"),))] == 1


def test_worker_gauges_follow_the_pool_and_removed_workers_disappear(served):
    metrics, url = served
    metrics.set_worker_gauges("decode-0", running=3, waiting=1, kv_blocks_used=40,
                              kv_blocks_free=60)
    metrics.set_worker_gauges("decode-1", running=0, waiting=0, kv_blocks_used=0,
                              kv_blocks_free=100)
    metrics.set_router_queue(5)
    samples = _scrape(url)
    assert samples[("pdserve_requests_running", (("worker", "decode-0"),))] == 3
    assert samples[("pdserve_requests_waiting", (("worker", "decode-0"),))] == 1
    assert samples[("pdserve_requests_waiting", (("worker", "router"),))] == 5
    assert samples[("pdserve_kv_blocks_used", (("worker", "decode-0"),))] == 40
    assert samples[("pdserve_kv_blocks_free", (("worker", "decode-1"),))] == 100
    metrics.remove_worker("decode-0")
    metrics.remove_worker("never-seen")
    samples = _scrape(url)
    assert ("pdserve_kv_blocks_used", (("worker", "decode-0"),)) not in samples
    assert ("pdserve_requests_running", (("worker", "decode-0"),)) not in samples
    assert samples[("pdserve_kv_blocks_free", (("worker", "decode-1"),))] == 100


def test_registries_are_private_and_render_matches_the_endpoint(served):
    metrics, url = served
    other = RouterMetrics()
    other.observe_first_token(9.0)
    metrics.observe_first_token(0.1)
    assert _samples(metrics.render().decode())[("pdserve_ttft_seconds_count", ())] == 1
    assert _samples(other.render().decode())[("pdserve_ttft_seconds_sum", ())] == 9.0
    assert _scrape(url)[("pdserve_ttft_seconds_sum", ())] == pytest.approx(0.1)


def test_close_stops_serving():
    metrics = RouterMetrics()
    server = start_metrics_server(metrics.registry, "127.0.0.1", 0, Gate(), Refusals())
    assert server.port > 0
    server.close()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=2)


def test_the_router_queue_gauge_follows_admission():
    """The gauge production sets: requests waiting in the router's admission queue, 0 once placed."""
    metrics = RouterMetrics()
    admission = Admission(max_queue=4, on_waiting=metrics.set_router_queue)
    queued = lambda: metrics.registry.get_sample_value("pdserve_requests_waiting", {"worker": "router"})  # noqa: E731

    async def scenario() -> list[float]:
        room = asyncio.Event()
        seen = []

        async def try_place(deadline):
            seen.append(queued())
            return "placed" if room.is_set() else None

        task = asyncio.create_task(admission.place(try_place, lambda: True, timeout_s=10))
        while len(seen) < 2:  # the first try found no room; the tick brought a second
            await asyncio.sleep(0.01)
        room.set()
        assert (await task)[0] == "placed"
        return seen

    assert asyncio.run(scenario())[:2] == [1, 1]
    assert queued() == 0


def test_a_request_log_line_carries_the_finish_text_and_the_usage_figures():
    handle = io.StringIO()
    log = RequestLog(handle, with_prompts=False)
    life = RequestLife("req-1", 3, list(range(20)), SamplingParams(), time.perf_counter())
    life.record([7, 8], "ab")
    usage = Usage(prompt_tokens=20, completion_tokens=2, ttft_ms=4.5, queue_ms=1.25, prefill_worker="prefill-0",
                  decode_worker="decode-1", prefill_ms=3.0, kv_transfer_ms=0.5, kv_transfer_bytes=2048,
                  migrations=1, cached_tokens=16, kv_cached_blocks=1, kv_wait_ms=0.25, prefill_queue_ms=0.75,
                  prefill_compute_ms=2.0, token_steps="FK")
    log.write(life, FinishReason.LENGTH, usage)
    line = json.loads(handle.getvalue())
    timings = {k: line.pop(k) for k in ("timestamp", "time_unix", "e2e_ms")}
    assert all(isinstance(v, float) for v in timings.values())
    assert line == {"input_length": 20, "output_length": 2, "hash_ids": [], "request_id": "req-1",
                    "finish_reason": "length", "ttft_ms": 4.5, "queue_ms": 1.25, "prefill_worker": "prefill-0",
                    "decode_worker": "decode-1", "prefill_ms": 3.0, "kv_transfer_ms": 0.5, "kv_transfer_bytes": 2048,
                    "migrations": 1, "cached_tokens": 16, "kv_cached_blocks": 1, "kv_wait_ms": 0.25,
                    "prefill_queue_ms": 0.75, "prefill_compute_ms": 2.0}


# ---- hostile clients on the metrics port -------------------------------------------------------
def _tls_server(pki) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(str(pki / "server.pem"), str(pki / "server.key"))
    return context


@pytest.fixture(params=["plain", "tls"])
def port_kind(request, pki):
    """(server TLS context or None, the scrape URL's scheme, the client TLS context or None)."""
    if request.param == "plain":
        return None, "http", None
    return _tls_server(pki), "https", ssl.create_default_context(cafile=str(pki / "ca.pem"))


def _idle(port: int) -> socket.socket:
    """A client that connects and sends nothing."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    time.sleep(0.2)  # accepted by now
    return sock


def _closed_by_server(sock: socket.socket, within_s: float) -> bool:
    """True when the server ends the connection within `within_s` (end of stream or reset)."""
    sock.settimeout(within_s)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_an_idle_connection_blocks_neither_a_scrape_nor_close(port_kind):
    tls, scheme, client_tls = port_kind
    metrics = RouterMetrics()
    metrics.set_router_queue(3)
    server = start_metrics_server(metrics.registry, "127.0.0.1", 0, Gate(), Refusals(), tls)
    idle = [_idle(server.port) for _ in range(3)]
    url = f"{scheme}://127.0.0.1:{server.port}/metrics"
    with urllib.request.urlopen(url, timeout=3, context=client_tls) as response:
        assert _samples(response.read().decode())[("pdserve_requests_waiting", (("worker", "router"),))] == 3
    closer = threading.Thread(target=server.close, kwargs={"deadline_s": 1.0}, daemon=True)
    started = time.monotonic()
    closer.start()
    closer.join(timeout=3.0)
    assert not closer.is_alive() and time.monotonic() - started < 2.0
    assert all(_closed_by_server(sock, 1.0) for sock in idle)  # shut, not left to hang
    for sock in idle:
        sock.close()


def test_a_silent_client_is_dropped_after_its_timeout_and_a_slow_one_at_its_deadline():
    server = start_metrics_server(RouterMetrics().registry, "127.0.0.1", 0, Gate(), Refusals(),
                                  limits=ConnectionLimits(io_timeout_s=0.3, connection_deadline_s=60.0))
    try:
        silent = _idle(server.port)
        assert _closed_by_server(silent, 2.0)
        silent.close()
    finally:
        server.close()
    server = start_metrics_server(RouterMetrics().registry, "127.0.0.1", 0, Gate(), Refusals(),
                                  limits=ConnectionLimits(io_timeout_s=60.0, connection_deadline_s=0.5))
    try:
        slow = _idle(server.port)
        slow.sendall(b"GET /metr")  # and never the rest
        assert _closed_by_server(slow, 3.0)
        slow.close()
    finally:
        server.close()


def test_connections_beyond_the_cap_are_closed_at_once():
    server = start_metrics_server(RouterMetrics().registry, "127.0.0.1", 0, Gate(), Refusals(),
                                  limits=ConnectionLimits(io_timeout_s=60.0, max_connections=2))
    try:
        held = [_idle(server.port) for _ in range(2)]
        extra = _idle(server.port)
        assert _closed_by_server(extra, 1.0)
        assert not any(_closed_by_server(sock, 0.2) for sock in held)  # the first two keep their slots
        for sock in (*held, extra):
            sock.close()
        time.sleep(0.3)  # their threads see the end of stream and leave
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=3) as response:
            assert response.status == 200
    finally:
        server.close()
