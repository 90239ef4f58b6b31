"""The soak (stress/soak.py), 9 seconds of it on the session's shared 1 + 1 cluster with the HTTP
door: requests complete, bad requests get exactly their status and nothing else fails, no KV
block leaks; and the verdict's rules without a cluster."""

from __future__ import annotations

import pytest

from stress import soak, soak_load

pytestmark = pytest.mark.usefixtures("ray_instance")  # one local Ray for the module (conftest)

EXPECTED = {"INVALID_ARGUMENT", "400", "404"}  # soak_load.BAD_GRPC and soak_load.BAD_HTTP's statuses


def test_a_short_soak_completes_with_only_the_expected_errors_and_no_leak(served):
    doc = soak.soak(served, soak.SoakOptions(minutes=0.1, sample_s=3.0, concurrency=3, seed=1))
    print({k: doc[k] for k in ("sent", "completed", "cancelled", "errors_by_status", "rss_growth_mb")})
    assert doc["completed"] > 0 and doc["cancelled"] > 0
    assert doc["tokens_checked"] > 0 and doc["tokens_wrong"] == []  # greedy requests are token-exact
    assert doc["unexpected_errors"] == {}
    # bad requests were sent over both doors, and each got exactly its status (else it is unexpected)
    assert set(doc["errors_by_status"]) <= EXPECTED and {"INVALID_ARGUMENT", "400"} <= set(doc["errors_by_status"])
    assert doc["sent"] == doc["completed"] + doc["cancelled"] + sum(doc["errors_by_status"].values())
    workers = {w.name for w in served.router.pools.all()}
    assert set(doc["leaked_blocks"]) == workers and not any(doc["leaked_blocks"].values())
    assert not doc["integrity_errors"] and doc["pools_at_end"] == served.router.pools.targets
    assert set(doc["samples"]) == workers | {"router"}
    assert all(len(s) == 2 and all(mb > 0 for mb in s) for s in doc["samples"].values())  # at 4.5 s and 9 s


def test_a_bad_request_that_succeeds_or_a_good_one_that_fails_is_unexpected():
    tally = soak_load.Tally()
    tally.outcome("grpc", "OK")
    tally.outcome("grpc_bad", "INVALID_ARGUMENT", soak_load.BAD_GRPC)
    tally.outcome("grpc_bad", "OK", soak_load.BAD_GRPC)  # accepted what it must refuse
    tally.outcome("chat", "SHORT")  # fewer tokens than asked for
    tally.outcome("http_bad(model)", "400", "404")  # refused, but with the wrong status
    assert tally.completed == 1
    assert tally.errors_by_status == {"INVALID_ARGUMENT": 1, "SHORT": 1, "400": 1}
    assert tally.unexpected == {"grpc_bad OK": 1, "chat SHORT": 1, "http_bad(model) 400": 1}


def _doc(**changes) -> dict:
    doc = {"rss_growth_pct": {"router": 1.0, "decode-0": 4.9}, "completed": 10, "leaked_blocks": {"decode-0": 0},
           "tokens_checked": 5, "tokens_wrong": [],
           "integrity_errors": {}, "unexpected_errors": {}, "pools_at_end": {"decode": 1}}
    return doc | changes


@pytest.mark.parametrize("changes, missed", [
    ({}, None),
    ({"rss_growth_pct": {"router": 1.0, "decode-0": 5.1}}, "RSS grew over 5.0%"),
    ({"leaked_blocks": {"decode-0": 2}}, "leaked blocks"),
    ({"unexpected_errors": {"grpc UNAVAILABLE": 1}}, "unexpected errors"),
    ({"completed": 0}, "no request completed"),
    ({"tokens_wrong": [{"prompt": [5], "max_tokens": 1, "got": [6], "reference": [7]}]}, "1 of 5 greedy"),
    ({"tokens_checked": 0}, "no greedy request's tokens were checked"),
    ({"pools_at_end": {"decode": 0}}, "pools"),
])
def test_each_target_is_checked(changes, missed):
    got = soak.missed_targets(_doc(**changes), {"decode": 1})
    assert (got == []) if missed is None else (len(got) == 1 and got[0].startswith(missed)), got


@pytest.mark.parametrize("argv", [["--minutes", "0"], ["--minutes", "1", "--sample-s", "40"],
                                  ["--minutes", "1", "--concurrency", "0"]])
def test_bad_flags_exit_with_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        soak.main(argv)
    assert exit_.value.code == 2
    assert "--" in capsys.readouterr().err


def test_the_summary_names_each_process_and_the_verdict():
    doc = _doc(minutes=1, sent=3, completed=1, cancelled=1, errors_by_status={"400": 1},
               samples={"router": [400.0, 402.0], "decode-0": [500.0, 530.0]},
               rss_growth_pct={"router": 0.5, "decode-0": 6.0})
    missed = soak.missed_targets(doc, {"decode": 1})
    text = soak.summary(doc | {"targets_met": not missed, "missed_targets": missed})
    assert "router       RSS 400.0 -> 402.0 MB (+0.50%)" in text and "decode-0     RSS 500.0 -> 530.0 MB (+6.00%)" in text
    assert text.splitlines()[-1] == "targets missed: RSS grew over 5.0% after the warm-up: {'decode-0': 6.0}"
