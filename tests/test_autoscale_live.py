"""The planner on a real cluster (real Ray actors, gRPC, KV channels; the tiny model on CPU): the
same `Planner` object the simulator runs scales the prefill pool up when requests wait for a
prefill past the TTFT SLO, every request's tokens still arrive, `pdserve status` and /metrics show
the decision, and with traffic gone the pool drains back to its min with nothing lost; the
worker-hours ledger `pdserve bench --autoscale` keeps (bench/accounting.py) holds exactly the
workers the pool manager started and stopped. Config errors of `router.autoscale` exit 2 naming
the key."""

from __future__ import annotations

import logging
import random
import threading
import time

import pytest
import yaml

from bench.accounting import RecordingActors, scaling_actions, usage
from cli.main import main as pdserve
from client.grpc_client import format_status
from router.launch import LocalCluster
from router.pools.actors import RayActors
from tests.cluster_util import Client, cluster_config, held_engines, wait_until

pytestmark = pytest.mark.second_ray  # clusters of its own, mostly waiting: conftest's xdist groups


@pytest.mark.parametrize("autoscale, message", [
    ({"ttft_s": 0}, "router.autoscale.ttft_s: must be > 0"),
    ({"percentile": 120}, "router.autoscale.percentile: must be in (0, 100]"),
    ({"decode_min": 0}, "router.autoscale.decode_min: must be >= 1"),
    ({"prefill_min": 3, "prefill_max": 2}, "router.autoscale.prefill_max: must be >= prefill_min"),
    ({"band": 1.0}, "router.autoscale.band: must be in [0, 1)"),
    ({"profile": "guess"}, "router.autoscale.profile: expected one of 'cost_model', 'measured', 'online'"),
    ({"enabled": True, "max_workers": 1}, "router.autoscale.max_workers: the budget (1 workers) is below"),
    ({"enabled": True, "profile": "cost_model"}, "router.autoscale.profile: cost_model needs an emulated device"),
    ({"enabled": True, "profile": "measured", "measured_profile": "nowhere.yaml"},
     "router.autoscale.measured_profile: "),
    ({"interval": 5}, "router.autoscale.interval: unknown key"),
])
def test_a_bad_autoscale_value_exits_2_naming_the_key(tmp_path, autoscale, message, capsys):
    bad = tmp_path / "cluster.yaml"
    bad.write_text(yaml.safe_dump({"router": {"autoscale": autoscale}}))
    capsys.readouterr()
    code = pdserve(["serve", "--config", str(bad)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message in err[0], err


class PoolEvents(logging.Handler):
    """The pool manager's own "started NAME" / "stopped NAME" lines, stamped on the router's clock
    as they are logged (right after the start's ready reply, right after the kill)."""

    def __init__(self):
        super().__init__()
        self.events: list[tuple[str, str, float]] = []

    def emit(self, record: logging.LogRecord) -> None:
        what = record.getMessage().split()
        if what[0] in ("started", "stopped"):
            self.events.append((what[0], what[1], time.monotonic()))


@pytest.fixture(scope="module")
def autoscaled(ray_instance, llama_dir):
    """1 + 1 workers, the planner on every 0.5 s with a 0.3 s TTFT SLO; prefill may grow to 2.
    Its workers' lives are recorded as `pdserve bench --autoscale` records them."""
    cfg = cluster_config(llama_dir, router={"call_timeout_s": 5, "drain_timeout_s": 5, "autoscale": {
        "enabled": True, "ttft_s": 0.3, "interval_s": 0.5, "prefill_max": 2, "decode_max": 1,
        "scale_up_cooldown_s": 1, "scale_down_cooldown_s": 3, "warmup_s": 0, "profile": "online"}})
    events, manager = PoolEvents(), logging.getLogger("router.pools.manager")
    manager.addHandler(events)
    level = manager.level
    manager.setLevel(logging.INFO)  # setLevel, not `.level =`: it clears the cached isEnabledFor answers
    actors = RecordingActors(RayActors())
    try:
        with LocalCluster(cfg, actors=actors) as cluster:
            cluster.recorded, cluster.pool_events = actors, events.events
            yield cluster
    finally:
        manager.removeHandler(events)
        manager.setLevel(level)


def test_the_planner_scales_a_live_pool_up_and_back_down(autoscaled, tmp_path):
    router, client = autoscaled.router, Client(autoscaled.address)
    rng = random.Random("autoscale-live")
    prompts = [[rng.randrange(10, 2000) for _ in range(120)] for _ in range(12)]
    first = router.pools.ready("prefill")[0]
    results: list = []
    # its prompts wait until another prefill worker is ready (TTFT passes the SLO meanwhile), however
    # long a start takes on this host: a fixed 6 s hold let a slow start be scaled away as it came up.
    # At most 20 s, under router.unresponsive_s (30 s): the held worker is slow, never replaced.
    with held_engines([first], 20.0, tmp_path):
        sender = threading.Thread(target=lambda: results.extend(client.many(prompts, max_tokens=8, ignore_eos=True)))
        sender.start()
        wait_until(lambda: any(w.name != first.name for w in router.pools.ready("prefill")), 120,
                   "a second prefill worker")
    sender.join(120)
    assert len(results) == 12 and all(len(tokens) == 8 for tokens in results)
    up = next(d for d in router.autoscaler.decisions if d.desired("prefill") == 2)
    assert up.changed and up.pools["prefill"].cause == "slo" and up.inputs["first_token_wait_s"] > 0.3
    status = format_status(client.status())
    assert "autoscale: last decision" in status and "prefill" in status
    metrics = router.metrics.render().decode()
    assert 'pdserve_autoscale_actions_total{direction="up",pool="prefill"} 1.0' in metrics
    wait_until(lambda: len(router.pools.live("prefill")) == 1, 120, "the prefill pool back at its min")
    down = router.autoscaler.decisions.index(up) < next(i for i, d in enumerate(router.autoscaler.decisions)
                                                       if d.desired("prefill") == 1 and d.changed)
    assert down and router.pools.health["prefill"].target == 1
    assert client.many(prompts[:2], max_tokens=4, ignore_eos=True)[0]  # still serving after the drain
    client.close()


def test_the_worker_hours_ledger_holds_exactly_the_pool_managers_starts_and_kills(autoscaled):
    """After the scale up and back down above: one life per worker the pool manager started (its
    start call before its "started" line), a stop for exactly the one it stopped (between the
    scale-down decision and its "stopped" line), and the figures integrate those lives."""
    ledger, events = autoscaled.recorded.ledger, list(autoscaled.pool_events)
    started = [name for what, name, _ in events if what == "started"]
    stopped = [name for what, name, _ in events if what == "stopped"]
    assert [life.name for life in ledger.lives] == ["prefill-0", "decode-1", "prefill-2"] == sorted(
        started, key=lambda n: int(n.split("-")[1]))
    assert [life.pool for life in ledger.lives] == ["prefill", "decode", "prefill"]
    assert [life.name for life in ledger.lives if life.stop is not None] == stopped == ["prefill-2"]
    logged = {(what, name): at for what, name, at in events}
    decisions = autoscaled.router.autoscaler.decisions
    up = next(d for d in decisions if d.desired("prefill") == 2)
    down = next(d for d in decisions if d.at > up.at and d.desired("prefill") == 1 and d.changed)
    extra = ledger.lives[2]
    assert up.at <= extra.start <= logged[("started", "prefill-2")]
    assert down.at <= extra.stop <= logged[("stopped", "prefill-2")]
    t0, end = max(ledger.lives[0].start, ledger.lives[1].start), time.monotonic()
    used = usage(ledger, t0, end)
    assert used["worker_hours"] == pytest.approx((2 * (end - t0) + extra.stop - extra.start) / 3600)
    assert used["peak_workers"] == 3 and 2 < used["mean_workers"] < 3
    assert scaling_actions(decisions, ledger, t0) == sum(d.changed for d in decisions) >= 2
