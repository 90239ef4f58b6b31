"""Shared fixtures: tiny deterministic checkpoints made once per test session, one local Ray for
the session, and the session's default cluster."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    from checkpoints.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("models")
    return {arch: str(make_tiny_model(root / arch, arch=arch, size="tiny", seed=0)) for arch in ("llama", "qwen2")}


@pytest.fixture(scope="session")
def llama_dir(model_dirs) -> str:
    return model_dirs["llama"]


RAY_OPTIONS = dict(num_cpus=8, include_dashboard=False, object_store_memory=128 << 20, log_to_driver=False)
_SHARED: dict = {}  # name -> the running LocalCluster shared by several modules
SHARED_FIXTURES = {"served": "served", "served_2x2": "2x2", "served_colocated": "colocated", "served_small": "small"}
_LAST_MODULE: dict[str, str] = {}  # shared cluster name -> the last module of the run that uses it


def pytest_addoption(parser):
    parser.addoption("--exhaustive", action="store_true",
                     help="also run the tests marked exhaustive (`bash scripts/test.sh --all`)")


def _deselect_exhaustive(config, items) -> None:
    """Tests marked exhaustive (a matrix whose every code path a CI test already covers) run only
    with --exhaustive, or when -m names them."""
    if config.getoption("--exhaustive") or "exhaustive" in (config.getoption("markexpr") or ""):
        return
    dropped = [item for item in items if item.get_closest_marker("exhaustive")]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if not item.get_closest_marker("exhaustive")]


def _group_ray_tests(items) -> None:
    """scripts/test.sh runs the suite on two xdist workers (`-n 2 --dist loadgroup`), with the
    tests that use Ray in three groups, each run in order by one worker:
    - "ray": the tests on the session's Ray (`ray_instance`, the shared clusters), as one process
      would run them;
    - "second_ray": modules marked `second_ray`, whose tests start clusters of their own on a
      local Ray and wait on deadlines more than they compute: the other worker runs them on a
      Ray of its own, beside the first group;
    - "own_ray": the tests that start Ray nodes of their own (`no_shared_ray`, or marked `ray`: a
      `pdserve serve` in a subprocess). They mostly wait on processes, so they too run beside
      the first group instead of after it.
    The rest (kernels, engines in process, the simulator, the CLI's usage errors) go one at a time
    to whichever worker is free."""
    for item in items:
        if "no_shared_ray" in item.fixturenames or item.get_closest_marker("ray"):
            item.add_marker(pytest.mark.xdist_group("own_ray"))
        elif "ray_instance" in item.fixturenames:
            second = item.get_closest_marker("second_ray")
            item.add_marker(pytest.mark.xdist_group("second_ray" if second else "ray"))


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config, items):
    """Exhaustive tests are left out unless asked for (_deselect_exhaustive). The tests that start Ray nodes of their own (no_shared_ray) go last: they stop the session's
    Ray, and every shared cluster with it. Each shared cluster stops after the last module that
    uses it (an idle cluster still costs polling and memory)."""
    _deselect_exhaustive(config, items)
    items.sort(key=lambda item: "no_shared_ray" in item.fixturenames)  # stable: otherwise as collected
    _group_ray_tests(items)
    for item in items:
        for fixture, name in SHARED_FIXTURES.items():
            if fixture in item.fixturenames:
                _LAST_MODULE[name] = item.module.__name__


@pytest.fixture(scope="module")
def ray_instance(_ray_at_exit):
    """One local Ray for the whole session, started by the first module that asks for it: the
    modules' clusters come and go on it (a Ray start costs about 7 s here). Workers are unnamed
    actors, so a module's leftovers cannot collide with the next module's."""
    import ray

    if not ray.is_initialized():
        ray.init(**RAY_OPTIONS)
    yield


@pytest.fixture(scope="session")
def _ray_at_exit():
    yield
    import ray

    _stop_shared()
    ray.shutdown()


def _stop_shared() -> None:
    while _SHARED:
        _, cluster = _SHARED.popitem()
        cluster.__exit__(None, None, None)


@pytest.fixture(scope="module")
def no_shared_ray():
    """For a module that starts Ray nodes of its own: the shared clusters and Ray stop first
    (the next module that asks for them starts them again)."""
    import os

    import ray

    from router import leftovers

    _stop_shared()
    leftovers.adopt_orphans()  # the dying raylet's agents become ours, to end before the next start
    ray.shutdown()
    leftovers.end(leftovers.below(os.getpid()))


@pytest.fixture(scope="session")
def pki(tmp_path_factory):
    """A throw-away CA, a server certificate for localhost and 127.0.0.1, a client certificate."""
    from tests.security_util import make_pki

    return make_pki(tmp_path_factory.mktemp("pki"))


def _shared(request, name: str, make_config):
    """The running shared cluster `name`, started with `make_config()` if there is none; then,
    after the module, checked as the module must leave it: no request in flight, every pool at its
    size with every worker ready, no KV block held, no fault on. A module that broke it fails
    there, and the next module gets a fresh one. After the last module that uses it, it stops."""
    from router.launch import LocalCluster
    from tests.cluster_util import wait_until, whole
    from worker_runtime.faults import FaultConfig

    cluster = _SHARED.get(name)
    if cluster is None:
        cluster = _SHARED[name] = LocalCluster(make_config()).__enter__()
    yield cluster
    try:
        wait_until(lambda: whole(cluster), 60, f"the shared cluster {name!r} to be whole again after the module",
                   every=0.1)
        assert cluster.router.pools.faults == FaultConfig(), f"the module left faults on in {name!r}"
    except BaseException:
        _SHARED.pop(name, None)
        cluster.__exit__(None, None, None)
        raise
    if _LAST_MODULE.get(name) == request.module.__name__ and _SHARED.get(name) is cluster:
        del _SHARED[name]
        cluster.__exit__(None, None, None)


@pytest.fixture(scope="module")
def served(request, ray_instance, llama_dir, tmp_path_factory):
    """The session's default cluster, for every module whose tests it fits: disaggregated, 1
    prefill + 1 decode worker (`torch_threads: auto`, the default), gRPC, the OpenAI HTTP API, Prometheus metrics and a request log
    (`served.cfg.router.request_log`). A cluster start costs 8-10 s here, so the first module that
    asks starts it and the others share it. A module may use it in any way that leaves it as it
    found it (scaled back, healed, faults off: see _shared); it cannot rely on an empty prefix
    cache or on counters at zero, so it compares counters before and after."""
    from tests.cluster_util import cluster_config

    def config():
        log = tmp_path_factory.mktemp("served") / "requests.jsonl"
        return cluster_config(llama_dir, router={"http_port": 0, "request_log": str(log)},
                              prefill={"torch_threads": "auto", "malloc": "auto"},
                              decode={"torch_threads": "auto", "malloc": "auto"})
    yield from _shared(request, "served", config)


CHUNKED = {"chunk_size": 16, "max_num_batched_tokens": 16}  # one KV block per prefill step: many pieces


@pytest.fixture(scope="module")
def served_2x2(request, ray_instance, llama_dir):
    """A shared disaggregated cluster of 2 prefill + 2 decode workers (placement: cache_aware),
    prefilling one 16-token block per step, each block's KV streamed as it is computed; quick to
    replace a dead worker (restart_backoff_s 0.2), short call deadlines (3 s), a drain that moves
    what is left after 1 s, up to 20 migrations of a request: for the tests that place across
    workers, stream KV in pieces, fail transfers, kill, drain and scale (same rules as `served`)."""
    from tests.cluster_util import cluster_config

    yield from _shared(request, "2x2", lambda: cluster_config(
        llama_dir, prefill={"replicas": 2}, decode={"replicas": 2}, scheduler=CHUNKED,
        kv_transfer={"stream_chunks": True},
        router={"call_timeout_s": 3, "restart_backoff_s": 0.2, "drain_timeout_s": 1, "migration_limit": 20}))


@pytest.fixture(scope="module")
def served_colocated(request, ray_instance, llama_dir):
    """A shared colocated cluster of 2 workers (`torch_threads: auto`, the default), quick to
    replace a dead one (same rules as `served`)."""
    from tests.cluster_util import cluster_config

    yield from _shared(request, "colocated", lambda: cluster_config(
        llama_dir, mode="colocated", prefill={"replicas": 0},
        decode={"replicas": 2, "torch_threads": "auto", "malloc": "auto"},
        router={"restart_backoff_s": 0.2}))


@pytest.fixture(scope="module")
def served_small(request, ray_instance, llama_dir):
    """A shared 1 + 1 cluster with tight router limits (one prefill at a time, a queue of one, one
    migration, 2 s call deadlines, a worker silent for 4 s replaced after 0.2 s), 32-token prefill
    chunks and no prefix cache: for the fault tests of saturation, hangs and an empty pool, and
    the prefix tests with caching off (same rules as `served`)."""
    from tests.cluster_util import cluster_config

    yield from _shared(request, "small", lambda: cluster_config(
        llama_dir, kv_cache={"prefix_caching": False}, scheduler={"chunk_size": 32, "max_num_batched_tokens": 32},
        router={"max_prefill_inflight": 1, "max_queue": 1, "migration_limit": 1, "call_timeout_s": 2,
                "unresponsive_s": 4, "restart_backoff_s": 0.2}))


@pytest.fixture(scope="session")
def family_dir(tmp_path_factory):
    """family name -> the directory of its tiny random checkpoint (checkpoints/families.py),
    built on first use and shared by the session."""
    from checkpoints.families import make_family_model

    root = tmp_path_factory.mktemp("families")
    built: dict[str, str] = {}

    def get(family: str) -> str:
        if family not in built:
            built[family] = str(make_family_model(root / family, family))
        return built[family]
    return get
