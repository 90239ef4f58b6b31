"""`pdserve role WORKER prefill|decode` on the shared live 2 + 2 cluster (real Ray, gRPC, the tiny
model): a prefill worker becomes a decode worker through Admin/ChangeRole, `pdserve status` lists
it in its new pool under its new name, it serves, and it changes back (the cluster is left as it
was found). Each refusal is a status a person can read and exit 1: an unknown worker
(NOT_FOUND), a change the pools forbid (FAILED_PRECONDITION), a busy worker with --if-idle
(FAILED_PRECONDITION, nothing changed); a role that is no pool is a usage error (exit 2)."""

from __future__ import annotations

import threading

import pytest

from cli.main import main as pdserve
from tests.cluster_util import Client, held_engines, wait_until


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = pdserve(list(argv))
    out = capsys.readouterr()
    return code, out.out.strip(), out.err.strip()


def _status(capsys, address: str) -> dict[str, str]:
    """Worker name -> pool, as `pdserve status` prints them."""
    code, out, _ = _run(capsys, "status", "--router", address)
    assert code == 0
    return {line.split()[0]: line.split()[1] for line in out.splitlines()
            if line.split() and line.split()[0].startswith(("prefill-", "decode-"))}


def test_a_prefill_worker_becomes_a_decode_worker_by_hand_and_back(served_2x2, capsys):
    address, pools = served_2x2.address, served_2x2.router.pools
    moving = pools.ready("prefill")[-1].name
    code, out, err = _run(capsys, "role", moving, "decode", "--router", address)
    assert code == 0, err
    new = out.split()[3]
    assert out.startswith(f"{moving} is now {new} in the decode pool, weights kept (role change in ")
    listed = _status(capsys, address)
    assert listed[new] == "decode" and moving not in listed
    assert sorted(listed.values()).count("decode") == 3 and pools.targets == {"prefill": 1, "decode": 3}
    client = Client(address)
    served = {client.tokens([21 + i, 22, 23, 24], max_tokens=3, ignore_eos=True)[1].usage.decode_worker
              for i in range(6)}
    assert served <= set(listed) and all(listed[w] == "decode" for w in served)
    code, out, err = _run(capsys, "role", new, "prefill", "--router", address)
    assert code == 0, err
    assert pools.targets == {"prefill": 2, "decode": 2} and _status(capsys, address)[out.split()[3]] == "prefill"
    client.close()


@pytest.mark.parametrize("worker, role, status, message", [
    ("nobody-7", "decode", "NOT_FOUND", "no live worker is named 'nobody-7' (live: "),
    ("PREFILL", "prefill", "FAILED_PRECONDITION", "is a prefill worker already"),
])
def test_a_refused_change_is_a_status_and_exit_1(served_2x2, capsys, worker, role, status, message):
    name = served_2x2.router.pools.ready("prefill")[0].name if worker == "PREFILL" else worker
    code, out, err = _run(capsys, "role", name, role, "--router", served_2x2.address)
    assert code == 1 and not out and err.startswith(f"pdserve: {status}: ") and message in err, err
    assert served_2x2.router.pools.targets == {"prefill": 2, "decode": 2}


def test_a_busy_worker_is_refused_with_if_idle_and_nothing_changes(served_2x2, capsys, tmp_path):
    pools, client = served_2x2.router.pools, Client(served_2x2.address)
    reply: list = []
    # the request's prefill waits on whichever worker it is placed until the refused change below,
    # under the 3 s call deadline
    with held_engines(pools.ready("prefill"), 2.8, tmp_path):
        sender = threading.Thread(
            target=lambda: reply.append(client.tokens([31, 32, 33], max_tokens=2, ignore_eos=True)))
        sender.start()
        wait_until(lambda: any(w.inflight for w in pools.live("prefill")), 30,
                   "the request placed on a prefill worker")
        busy = next(w.name for w in pools.live("prefill") if w.inflight)
        code, out, err = _run(capsys, "role", busy, "decode", "--if-idle", "--router", served_2x2.address)
    sender.join(60)
    assert code == 1 and err.startswith("pdserve: FAILED_PRECONDITION: ") and f"{busy} holds " in err, err
    assert "of the router's requests" in err and "not changed" in err
    assert reply and len(reply[0][0]) == 2  # the request it held finished
    assert busy in {w.name for w in pools.live("prefill")} and pools.targets == {"prefill": 2, "decode": 2}
    client.close()


def test_a_role_that_is_no_pool_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        pdserve(["role", "prefill-0", "router"])
    assert exit_.value.code == 2 and "invalid choice: 'router'" in capsys.readouterr().err
