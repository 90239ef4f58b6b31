"""pdserve on a multi-node Ray cluster, made on one host: a network namespace joined to the root
namespace by a veth pair is the second machine.

The Ray head runs in the root namespace on the pair's root-side address and offers the custom
resource `prefill_node`; the remote node runs inside the namespace on the other end with the
label pdserve-role=decode. `pdserve serve` joins through `ray.address`, so prefill runs on one
node, decode on the other, and every KV byte crosses the veth. Later a spare decode-labelled node
joins in the root namespace, the remote node is stopped mid-stream, and the requests move there.
Only the pair's /30 and loopback are used. Needs root and `ip` (skips otherwise, saying which);
the last test tears everything down and finds no namespace, link or Ray process left.
"""

from __future__ import annotations

import os
import random
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import ray
import torch
import yaml

from client.grpc_client import format_status
from kv_transfer import KVReceiver, KVSender, KVTransferConfig, KVTransferError
from proto import pdserve_pb2 as pb
from router.config.loader import parse_config
from router.config.typed_yaml import ConfigError
from router.lifecycle.outcomes import CannotPlace
from router.pools.actors import labels_match
from router.pools.manager import PoolManager
from tests import process_util
from tests.cluster_util import Client, free_port, kv_bytes
from tests.reference import hf_greedy

BIN = Path(sys.executable).parent
STREAM_TOKENS = 200  # with faults.step_delay_s 0.02: 4 s or more, so the node stops mid-stream


# ---- without root: the config keys, the messages, the status text ---------------------------
@pytest.mark.parametrize("raw, message", [
    ({"prefill": {"label_selector": {"role": "-x"}}}, "prefill.label_selector.role: '-x' is not a label selector"),
    ({"decode": {"label_selector": {"a/b/c": "x"}}}, "decode.label_selector.a/b/c: is not a Ray label key"),
    ({"decode": {"label_selector": {"role": 1}}}, "decode.label_selector: expected a mapping of name to a string"),
    ({"decode": {"resources": {"GPU": 1}}}, "decode.resources.GPU: use decode.num_cpus / decode.num_gpus"),
    ({"prefill": {"resources": {"prefill_node": 0}}}, "prefill.resources.prefill_node: must be > 0"),
    ({"kv_transfer": {"interface": "eth 1"}}, "kv_transfer.interface: must be a network interface name"),
])
def test_placement_and_interface_keys_are_validated(raw, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        parse_config(raw)
    good = parse_config({"decode": {"label_selector": {"pdserve-role": "in(decode, spare)"}},
                         "prefill": {"resources": {"prefill_node": 1}}, "kv_transfer": {"interface": "eth1"}})
    assert good.decode.label_selector == {"pdserve-role": "in(decode, spare)"} and good.kv_transfer.interface == "eth1"


def test_label_selectors_match_like_ray():
    node = {"pdserve-role": "decode", "zone": "b"}
    assert labels_match({"pdserve-role": "decode"}, node) and not labels_match({"pdserve-role": "prefill"}, node)
    assert labels_match({"zone": "in(a, b)"}, node) and not labels_match({"zone": "!in(a,b)"}, node)
    assert labels_match({"gpu": "!h100"}, node) and not labels_match({"gpu": "h100"}, node)


def test_a_scale_no_node_can_take_is_refused_naming_the_selector(monkeypatch):
    cfg = parse_config({"decode": {"label_selector": {"pdserve-role": "decode"}, "resources": {"decode_node": 1}}})
    pools = PoolManager(cfg)
    monkeypatch.setattr(ray, "available_resources", lambda: {"CPU": 8.0, "decode_node": 1.0})
    monkeypatch.setattr(ray, "nodes", lambda: [
        {"Alive": True, "NodeManagerAddress": "10.0.0.1", "Labels": {"pdserve-role": "prefill", "ray.io/node-id": "ab"}},
        {"Alive": False, "NodeManagerAddress": "10.0.0.2", "Labels": {"pdserve-role": "decode"}}])
    with pytest.raises(CannotPlace, match="they need 2 decode_node but the Ray cluster has 1 decode_node"):
        pools._check_placeable("decode", 2)
    with pytest.raises(CannotPlace, match=r"no live Ray node has labels matching decode.label_selector "
                                          r"\{'pdserve-role': 'decode'\} \(nodes: 10.0.0.1 \{'pdserve-role': 'prefill'\}\)"):
        pools._check_placeable("decode", 1)


def test_an_unreachable_peer_names_both_ends():
    kv = torch.zeros(4, 2, 2, 4, 2, 8)  # [blocks, layers, 2, block_size, kv_heads, head_dim]
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # bound, never listening: connections are refused
        sender = KVSender(kv, KVTransferConfig(timeout_s=1.0))
        with pytest.raises(KVTransferError) as err:
            sender.connect("decode-7", "127.0.0.1", port, bytes(32))  # the secret does not matter here
    assert f"node 127.0.0.1 could not reach 127.0.0.1:{port} (joining its KV store" in str(err.value)
    assert "'decode-7'" in str(err.value)


def test_the_interface_picks_the_channel_address(monkeypatch):
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        monkeypatch.setenv(name, "unset")  # restored afterwards: the receiver sets them
    kv = torch.zeros(4, 2, 2, 4, 2, 8)
    receiver = KVReceiver(kv, "10.255.255.1", KVTransferConfig(interface="lo"), lambda *_: None, lambda *_: None)
    try:
        assert receiver.open_channel("prefill-0")[0] == "127.0.0.1"  # not the host it was given
        assert os.environ["GLOO_SOCKET_IFNAME"] == os.environ["NCCL_SOCKET_IFNAME"] == "lo"
    finally:
        receiver.shutdown()
    missing = f"pdnone{random.randrange(10**6)}"
    with pytest.raises(ValueError, match=f"decode node 10.0.0.9: kv_transfer.interface '{missing}' has no IPv4 "
                                         r"address on this node \(its interfaces: lo 127.0.0.1"):
        KVReceiver(kv, "10.0.0.9", KVTransferConfig(interface=missing), lambda *_: None, lambda *_: None)


def test_status_lists_the_workers_of_each_node():
    s = pb.StatusResponse(mode="disaggregated", model="m", workers=[
        pb.WorkerStatus(name="prefill-0", pool="prefill", state="ready", node_ip="10.0.0.1"),
        pb.WorkerStatus(name="decode-1", pool="decode", state="ready", node_ip="10.0.0.2"),
        pb.WorkerStatus(name="decode-2", pool="decode", state="ready", node_ip="10.0.0.2")])
    lines = format_status(s).splitlines()
    assert "node 10.0.0.1: prefill-0" in lines and "node 10.0.0.2: decode-1, decode-2" in lines


# ---- two Ray nodes on one host -----------------------------------------------------------------
class CommandFailed(RuntimeError):
    pass


def _run(*args, ns: str | None = None, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + [str(a) for a in args]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=180)
    if check and done.returncode:
        raise CommandFailed(f"{' '.join(cmd)} exited {done.returncode}: {(done.stdout + done.stderr)[-3000:]}")
    return done


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            pid, ppid = int(stat.parent.name), int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        tree.setdefault(ppid, []).append(pid)
    return tree


def _mentions(pid: Path, text: str) -> bool:
    """The process's command line, working directory or an open file names `text`."""
    try:
        if text in pid.joinpath("cmdline").read_bytes().decode(errors="replace"):
            return True
        links = [pid / "cwd", *pid.joinpath("fd").iterdir()]
        return any(text in os.readlink(link) for link in links)
    except OSError:
        return False


@dataclass
class TwoNodeHost:
    """A namespace + veth pair (the same interface name on both ends) and the Ray nodes on it.
    Everything it starts is found again by its unique temp dir or by the namespace's pids."""

    name: str
    root_ip: str
    ns_ip: str
    tmp: Path
    env: dict[str, str]
    log: Path  # pdserve serve's output, kept after teardown (pytest's tmp dir)
    gcs: str = ""
    serve: subprocess.Popen | None = None

    @classmethod
    def make(cls, log: Path) -> TwoNodeHost:
        taken = _run("ip", "-4", "-o", "addr").stdout
        octet = random.choice([o for o in range(256) if f" 10.213.{o}." not in taken])
        tmp = Path(tempfile.mkdtemp(prefix="pdmn", dir="/tmp"))  # short: Ray's socket paths live under it
        env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token",
               "RAY_AUTH_TOKEN": secrets.token_hex(32)}  # Ray's token auth, with a token of our own
        env.pop("RAY_ADDRESS", None)
        host = cls(f"pdmn{secrets.token_hex(4)}", f"10.213.{octet}.1", f"10.213.{octet}.2", tmp, env, log)
        try:
            host._link_up()
        except CommandFailed as e:
            host.down()
            pytest.skip(f"cannot make a network namespace and veth pair here: {e}")
        return host

    def _link_up(self) -> None:
        n = self.name
        _run("ip", "netns", "add", n)
        _run("ip", "link", "add", n, "type", "veth", "peer", "name", f"{n}p")
        _run("ip", "link", "set", f"{n}p", "netns", n)
        _run("ip", "-n", n, "link", "set", f"{n}p", "name", n)  # kv_transfer.interface: one name everywhere
        _run("ip", "addr", "add", f"{self.root_ip}/30", "dev", n)
        _run("ip", "-n", n, "addr", "add", f"{self.ns_ip}/30", "dev", n)
        for ns in (None, n):
            _run("ip", *(["-n", ns] if ns else []), "link", "set", n, "up")
        _run("ip", "-n", n, "link", "set", "lo", "up")

    def ray_node(self, tag: str, role: str, *, head: bool = False, remote: bool = False, cpus: int = 4) -> None:
        args = [BIN / "ray", "start", f"--temp-dir={self.tmp}/{tag}", f"--num-cpus={cpus}",
                "--object-store-memory=100000000", f"--labels=pdserve-role={role}", "--disable-usage-stats",
                f"--node-ip-address={self.ns_ip if remote else self.root_ip}"]
        if head:
            args += ["--head", "--port=0", "--include-dashboard=false", f"--ray-client-server-port={free_port()}",
                     '--resources={"prefill_node": 2}']
        else:
            args += [f"--address={self.gcs}"]
        _run(*args, ns=self.name if remote else None, env=self.env)
        if head:
            self.gcs = (self.tmp / tag / "ray_current_cluster").read_text().strip()

    def start_serve(self, config: dict) -> str:
        path = self.tmp / "cluster.yaml"
        path.write_text(yaml.safe_dump(config))
        with self.log.open("w") as out:
            self.serve = subprocess.Popen([BIN / "pdserve", "serve", "--config", path], stdout=out,
                                          stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        deadline = time.monotonic() + 180
        while "pdserve: ready in" not in self.log.read_text():
            assert self.serve.poll() is None and time.monotonic() < deadline, self.tail()
            time.sleep(0.2)
        return re.search(r"router listening on (\S+) ", self.log.read_text()).group(1)  # the port it bound

    def tail(self) -> str:
        return self.log.read_text()[-4000:] if self.log.exists() else "(no serve log)"

    def veth_tx_bytes(self) -> int:
        """Bytes sent from the root namespace into the namespace (the root end's counter)."""
        return int(Path(f"/sys/class/net/{self.name}/statistics/tx_bytes").read_text())

    def stop_remote(self, grace_s: float = 5.0) -> None:
        """What `ray stop` does on that machine: SIGTERM to its processes, SIGKILL after a grace."""
        pids = [int(p) for p in _run("ip", "netns", "pids", self.name).stdout.split()]
        _signal(pids, signal.SIGTERM)
        _wait_gone(pids, grace_s)
        _signal(pids, signal.SIGKILL)

    def down(self) -> None:
        """Stop everything this host started (idempotent; runs even after a failure)."""
        if self.serve is not None and self.serve.poll() is None:
            self.serve.send_signal(signal.SIGTERM)
            try:
                self.serve.wait(60)
            except subprocess.TimeoutExpired:
                self.serve.kill()
                self.serve.wait()
        if self.name in _run("ip", "netns", "list").stdout:
            self.stop_remote(grace_s=0)
        pids = self._ray_pids()
        _signal(pids, signal.SIGKILL)
        _wait_gone(pids, 10, zombies_gone=True)
        _run("ip", "link", "del", self.name, check=False)
        _run("ip", "netns", "del", self.name, check=False)
        shutil.rmtree(self.tmp, ignore_errors=True)

    def _ray_pids(self) -> list[int]:
        """Processes that name our temp dir, and their descendants (Ray's agents and workers)."""
        found = [int(p.name) for p in Path("/proc").glob("[0-9]*") if p.name != str(os.getpid())
                 and _mentions(p, str(self.tmp))]
        tree, todo = _children(), list(found)
        while todo:
            kids = tree.get(todo.pop(), [])
            found += kids
            todo += kids
        return sorted(set(found))

    def leftovers(self) -> list[str]:
        left = [f"process {pid}" for pid in self._ray_pids()]
        left += [f"namespace {self.name}"] if self.name in _run("ip", "netns", "list").stdout else []
        left += [f"link {self.name}"] if _run("ip", "link", "show", self.name, check=False).returncode == 0 else []
        return left + ([f"dir {self.tmp}"] if self.tmp.exists() else [])


def _signal(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _wait_gone(pids: list[int], timeout_s: float, zombies_gone: bool = False) -> None:
    """Until none of `pids` is left, or `timeout_s`. `zombies_gone`: a killed zombie, waiting for the
    container's pid 1 to reap it, counts as gone (the remote stop's grace keeps counting them: ending
    it at ~0.1 s made the router act on a node's departure after 37 s instead of 12)."""
    def left(pid: int) -> bool:
        return process_util.stat(pid) is not None if zombies_gone else Path(f"/proc/{pid}").exists()

    deadline = time.monotonic() + timeout_s
    while any(left(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)


@pytest.fixture(scope="module")
def host(tmp_path_factory, no_shared_ray):
    if os.geteuid() != 0:
        pytest.skip("needs root: it makes a network namespace and a veth pair")
    if shutil.which("ip") is None:
        pytest.skip("needs the `ip` command (iproute2)")
    two = TwoNodeHost.make(tmp_path_factory.mktemp("multinode") / "serve.log")
    try:
        two.ray_node("head", "prefill", head=True)
        two.ray_node("remote", "decode", remote=True)
        yield two
    finally:
        two.down()


@pytest.fixture(scope="module")
def two_nodes(host, llama_dir):
    config = {
        "model": {"path": llama_dir, "dtype": "float32"},  # the references' (as tests/cluster_util.py)
        "router": {"host": "127.0.0.1", "port": 0, "restart_backoff_s": 0.2, "unresponsive_s": 5,
                   "worker_start_timeout_s": 90, "queue_timeout_s": 90, "shutdown_grace_s": 1},
        "prefill": {"replicas": 1, "num_cpus": 0.5, "resources": {"prefill_node": 1}},
        "decode": {"replicas": 1, "num_cpus": 0.5, "label_selector": {"pdserve-role": "decode"}},
        "kv_cache": {"block_size": 16, "num_blocks": 512},
        "kv_transfer": {"timeout_s": 10, "interface": host.name},
        "ray": {"address": host.gcs},
        "faults": {"step_delay_s": 0.02},
    }
    client = Client(host.start_serve(config))
    yield client
    client.close()


def _nodes(client: Client) -> dict[str, str]:
    return {w.name: w.node_ip for w in client.status().workers}


@pytest.mark.slow
def test_prefill_and_decode_run_on_their_nodes_and_the_kv_crosses_the_link(host, two_nodes, llama_dir):
    nodes = _nodes(two_nodes)
    assert sorted(nodes.values()) == [host.root_ip, host.ns_ip]
    prefill = next(n for n in nodes if n.startswith("prefill"))
    assert nodes[prefill] == host.root_ip
    rng = random.Random(3)
    prompts = [[rng.randrange(10, 2000) for _ in range(rng.randint(300, 900))] for _ in range(6)]
    before = host.veth_tx_bytes()
    results = [two_nodes.tokens(p, max_tokens=8, ignore_eos=True) for p in prompts]
    sent = host.veth_tx_bytes() - before
    assert [tokens for tokens, _ in results] == [hf_greedy(llama_dir, p, 8, ignore_eos=True) for p in prompts]
    moved = [last.usage.kv_transfer_bytes for _, last in results]
    assert moved == [kv_bytes(llama_dir, len(p), 16) for p in prompts]  # every block of every prompt
    assert sent >= sum(moved), f"{sent} bytes crossed the veth, {sum(moved)} of them KV"
    status = two_nodes.status()
    assert {w.name: w.channels for w in status.workers if w.pool == "decode"} == {
        n: 1 for n in nodes if n.startswith("decode")}
    text = format_status(status)
    assert f"node {host.root_ip}: {prefill}" in text and f"node {host.ns_ip}: decode-" in text


@pytest.mark.slow
def test_scaling_the_decode_pool_lands_on_the_remote_node(host, two_nodes, llama_dir):
    reply = two_nodes.admin.Scale(pb.ScaleRequest(pool="decode", replicas=2), timeout=180)
    assert len(reply.started) == 1
    nodes = _nodes(two_nodes)
    assert nodes[reply.started[0]] == host.ns_ip
    assert sorted(ip for n, ip in nodes.items() if n.startswith("decode")) == [host.ns_ip] * 2
    rng = random.Random(4)
    prompts = [[rng.randrange(10, 2000) for _ in range(rng.randint(20, 200))] for _ in range(6)]
    assert two_nodes.many(prompts, max_tokens=10, ignore_eos=True) == [
        hf_greedy(llama_dir, p, 10, ignore_eos=True) for p in prompts]
    with pytest.raises(grpc.RpcError) as err:  # only the head offers prefill_node, 2 of them
        two_nodes.admin.Scale(pb.ScaleRequest(pool="prefill", replicas=5), timeout=60)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "prefill_node" in err.value.details()


@pytest.mark.slow
def test_a_node_that_leaves_mid_stream_moves_its_requests(host, two_nodes, llama_dir):
    # a spare decode-labelled node (root namespace) joins first; it takes over. The remote node
    # stops once every stream has its first 3 tokens: 197 more at >= 20 ms a step are still to come
    host.ray_node("spare", "decode", cpus=2)
    rng = random.Random(5)
    prompts = [[rng.randrange(10, 2000) for _ in range(rng.randint(10, 60))] for _ in range(3)]
    results: list = [None] * len(prompts)
    started = [threading.Event() for _ in prompts]

    def stream(i: int) -> None:
        tokens, last = [], None
        try:
            for msg in two_nodes.stream(prompts[i], max_tokens=STREAM_TOKENS, ignore_eos=True):
                tokens += msg.token_ids
                last = msg
                if len(tokens) >= 3:
                    started[i].set()
            results[i] = (tokens, last.usage.migrations)
        except grpc.RpcError as e:
            results[i] = e
        finally:
            started[i].set()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for ev in started:
        assert ev.wait(60), host.tail()
    assert all(result is None for result in results), "a stream ended before the node left"
    host.stop_remote()
    for t in threads:
        t.join(240)
    for prompt, result in zip(prompts, results, strict=True):
        assert not isinstance(result, grpc.RpcError), f"{result.code()}: {result.details()}\n{host.tail()}"
        tokens, migrations = result
        assert tokens == hf_greedy(llama_dir, prompt, STREAM_TOKENS, ignore_eos=True)
        assert migrations >= 1
    status = two_nodes.status()
    decode = next(p for p in status.pools if p.pool == "decode")
    assert decode.restarts >= 2 and "decode-" in decode.last_failure
    assert {w.node_ip for w in status.workers if w.pool == "decode"} == {host.root_ip}


@pytest.mark.slow
def test_teardown_leaves_no_namespace_link_or_ray_process(host, two_nodes):
    host.down()
    assert host.serve.returncode == 0, host.serve.returncode
    assert host.leftovers() == []
