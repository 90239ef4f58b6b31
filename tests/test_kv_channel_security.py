"""KV channels only their peer can join (docs/security.md): the handshake's proofs, a stranger who
joins the rendezvous first or races to its keys without the secret, and a stranger process spoiling
the store during a transfer: the peer's channel and its running transfer go on unchanged."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from kv_transfer import HandshakeMismatch, KVReceiver, KVSender, KVTransferConfig, KVTransferError
from kv_transfer import sender as kv_sender
from kv_transfer.groups import gloo_group, join_store
from kv_transfer.handshake import new_secret, proof, proves, rendezvous_prefix
from tests.kv_util import CONFIG, Owner, make_pool, wait_until


@pytest.fixture
def pair(request):
    """(owner, src, dst, receiver, sender): 20 reserved blocks, a 1 s resolve (a transfer stays in
    flight); the channel's config is CONFIG unless the test is parametrized with another."""
    config = getattr(request, "param", CONFIG)
    owner = Owner({"r": list(range(20, 40))}, resolve_delay_s=1.0)
    src, dst = make_pool(64, torch.float32, seed=0), make_pool(64, torch.float32)
    receiver = KVReceiver(dst, "127.0.0.1", config, owner.resolve, owner.complete)
    sender = KVSender(src, config)
    yield owner, src, dst, receiver, sender
    sender.shutdown()
    receiver.shutdown()


def test_handshake_proofs():
    secret, other, nonce = new_secret(), new_secret(), os.urandom(16)
    assert proves(secret, b"sender", nonce, proof(secret, b"sender", nonce))
    assert not proves(secret, b"sender", nonce, proof(other, b"sender", nonce))
    assert not proves(secret, b"receiver", nonce, proof(secret, b"sender", nonce))  # a Hello's proof is no Verdict's
    assert not proves(secret, b"sender", os.urandom(16), proof(secret, b"sender", nonce))
    assert not any(proves(secret, b"sender", nonce, bad) for bad in (None, 7, "", secret.hex()))
    assert rendezvous_prefix(secret) != rendezvous_prefix(other) and secret.hex() not in rendezvous_prefix(secret)


def test_a_stranger_who_joins_first_does_not_take_the_channel(pair):
    owner, src, dst, receiver, sender = pair
    host, port, secret = receiver.open_channel("p")
    store = join_store(host, port, 2.0)
    store.set("sender_joined", "1")  # what a sender without the secret would write
    failed = []
    thread = threading.Thread(target=lambda: _try(failed, lambda: gloo_group(store, 1, "127.0.0.1", 2.0)))
    thread.start()
    wrong = KVSender(src, KVTransferConfig(timeout_s=1.5, heartbeat_s=0.5, staging_bytes=64 << 10))
    with pytest.raises(KVTransferError):  # another secret: another rendezvous, nobody there
        wrong.connect("d", host, port, new_secret())
    wrong.shutdown()
    thread.join()
    assert failed, "a stranger built a gloo group with the receiver"
    sender.connect("d", host, port, secret)  # the peer still gets the channel it was sent to
    assert sender.send("d", "r", list(range(20))).result(20).dst_block_ids == list(range(20, 40))
    assert torch.equal(dst[20:40], src[:20])


def _try(failures: list, fn) -> None:
    try:
        fn()
    except (RuntimeError, ValueError) as e:
        failures.append(e)


def test_a_stranger_without_the_secret_is_refused_and_a_running_transfer_goes_on(pair, monkeypatch, caplog):
    owner, src, dst, receiver, sender = pair
    sender.connect("d", *receiver.open_channel("p"))
    running = sender.send("d", "r", list(range(20)))  # in flight for the next second
    host, port, secret = receiver.open_channel("q")
    # a stranger that won the race to the rendezvous keys (it listed the store's keys): it has the
    # prefix, not the secret; the Hello's proof gives it away before anything else is read
    monkeypatch.setattr(kv_sender, "rendezvous_prefix", lambda _: rendezvous_prefix(secret))
    stranger = KVSender(make_pool(64, torch.float32, seed=9), CONFIG)
    with pytest.raises(HandshakeMismatch, match="refused by the receiver: not authenticated"):
        stranger.connect("d", host, port, new_secret())
    stranger.shutdown()
    wait_until(lambda: "did not prove the channel secret" in caplog.text, 5, "the refusal in the log")
    assert running.result(20).dst_block_ids == list(range(20, 40))
    assert torch.equal(dst[20:40], src[:20])
    assert [(r, b, e) for r, b, e in owner.completed] == [("r", list(range(20, 40)), None)]
    wait_until(lambda: receiver.num_channels == 1, 5, "the refused rendezvous to close")


STRANGER = """
import socket, sys
from datetime import timedelta
import torch, torch.distributed as dist
host, port = sys.argv[1], int(sys.argv[2])
store = dist.TCPStore(host, port, None, False, timedelta(seconds=3))
print("joined", flush=True)
sys.stdin.readline()
keys = store.list_keys()
for key in keys:  # spoil every key but the receiver's own gloo address
    if not key.endswith("/0/0"):
        store.set(key, b"garbage")
store.set("sender_joined", "1")
for prefix in {key.split("/")[0] for key in keys if "/" in key}:  # then join its gloo pair as rank 1
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timedelta(seconds=2)
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    try:
        group = dist.ProcessGroupGloo(dist.PrefixStore("control/", dist.PrefixStore(prefix, store)), 1, 2, options)
        for tag in (1, 2, 3, 4, 5):  # every tag the channel uses, junk frames
            group.send([torch.full((512,), 7, dtype=torch.uint8)], 0, tag).wait(timedelta(seconds=1))
    except RuntimeError:
        pass
with socket.create_connection((host, port)) as raw:
    raw.sendall(b"\\xff" * 4096)
print("done", flush=True)
"""


PATIENT = KVTransferConfig(timeout_s=30.0, heartbeat_s=0.5, staging_bytes=64 << 10)


@pytest.mark.parametrize("pair", [PATIENT], indirect=True, ids=["30s-timeout"])
def test_a_stranger_process_on_the_store_during_a_transfer_changes_nothing(pair):
    """The transfer's blocks are resolved only once the stranger has done all its mischief, so
    every step of it happens while the transfer is in flight; then the payload lands at once
    (a stall would wait for the channel's 30 s timeout)."""
    owner, src, dst, receiver, sender = pair
    owner.gate = threading.Event()
    host, port, secret = receiver.open_channel("p")
    sender.connect("d", host, port, secret)
    stranger = subprocess.Popen([sys.executable, "-c", STRANGER, host, str(port)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert stranger.stdout.readline() == "joined\n"
        running = sender.send("d", "r", list(range(20)))  # held at its resolve until the gate opens
        stranger.stdin.write("go\n")
        stranger.stdin.flush()
        assert stranger.communicate(timeout=30)[0] == "done\n"
        assert not running.done(), "the transfer ended before the stranger was done"
        opened = time.monotonic()
        owner.gate.set()
        assert running.result(20).dst_block_ids == list(range(20, 40))
        assert time.monotonic() - opened < PATIENT.timeout_s / 6, "the transfer stalled"
    finally:
        stranger.kill()
    owner.gate = None
    assert torch.equal(dst[20:40], src[:20])
    owner.resolve_delay_s = 0.0
    dst[20:40] = 0
    assert sender.send("d", "r", list(range(20, 40))).result(10).dst_block_ids == list(range(20, 40))
    assert torch.equal(dst[20:40], src[20:40])
    assert [e for _, _, e in owner.completed] == [None, None] and receiver.num_channels == 1
