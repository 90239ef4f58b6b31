"""The committed generated gRPC modules match proto/pdserve.proto, and router/frontdoor/grpc_convert.py maps
the messages with presence: unset -> documented default, set -> used (and validated) as given."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from google.protobuf import descriptor_pb2

from proto import pdserve_pb2 as pb
from protocol.errors import InvalidRequest
from protocol.outputs import FinishReason
from protocol.sampling import SamplingParams
from protocol.usage import Usage
from router.frontdoor.grpc_convert import pool_status_to_proto, sampling_from_proto, usage_to_proto

ROOT = Path(__file__).resolve().parent.parent


def test_generated_modules_are_fresh():
    proc = subprocess.run([sys.executable, str(ROOT / "proto" / "gen_proto.py"), "--check"],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr


def _gen_on_a_copy(tmp_path, monkeypatch):
    """proto/gen_proto.py loaded as a module, its ROOT a copy of the proto folder under tmp_path."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_proto", ROOT / "proto" / "gen_proto.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    fake_root = tmp_path / "repo"
    (fake_root / "proto").mkdir(parents=True)
    for name in ("pdserve.proto", *gen.OUTPUTS):
        (fake_root / "proto" / name).write_bytes((ROOT / "proto" / name).read_bytes())
    monkeypatch.setattr(gen, "ROOT", fake_root)
    return gen, fake_root


def test_stale_check_notices_an_edit(tmp_path, monkeypatch):
    gen, fake_root = _gen_on_a_copy(tmp_path, monkeypatch)
    proto = fake_root / "proto" / "pdserve.proto"
    proto.write_text(proto.read_text().replace("message Usage {", "message Usage {\n  uint32 extra_field = 99;"))
    assert "pdserve_pb2.py" in gen.stale_files()


def test_stale_check_leaves_the_generators_version_stamps_alone(tmp_path, monkeypatch):
    """Another grpcio-tools or protoc release stamps its own version into the same code: not stale
    (a clean machine installs the newest tools); the committed stamps stay the lowest runtimes."""
    gen, fake_root = _gen_on_a_copy(tmp_path, monkeypatch)
    grpc_mod, pb2 = fake_root / "proto" / "pdserve_pb2_grpc.py", fake_root / "proto" / "pdserve_pb2.py"
    grpc_text = re.sub(r"GRPC_GENERATED_VERSION = '[^']*'", "GRPC_GENERATED_VERSION = '1.66.0'", grpc_mod.read_text())
    pb2_text = re.sub(r"# Protobuf Python Version: .*", "# Protobuf Python Version: 5.27.2", pb2.read_text())
    pb2_text = re.sub(r"(Domain\.PUBLIC,)\s*\d+,\s*\d+,\s*\d+,", r"\1\n    5,\n    27,\n    2,", pb2_text)
    assert "1.66.0" in grpc_text and "    27,\n" in pb2_text  # the stamps were there to change
    grpc_mod.write_text(grpc_text)
    pb2.write_text(pb2_text)
    assert gen.stale_files() == []
    grpc_mod.write_text(grpc_text.replace("def add_", "def add_x_", 1))  # the code itself: stale
    assert gen.stale_files() == ["pdserve_pb2_grpc.py"]


def test_unset_sampling_fields_take_the_documented_defaults():
    got = sampling_from_proto(pb.SamplingParams())
    assert got == SamplingParams(max_tokens=16, temperature=0.0, top_p=1.0, top_k=0, seed=None)
    got.validate()


@pytest.mark.parametrize("field, value, internal", [
    ("max_tokens", 7, 7), ("temperature", 0.5, 0.5), ("top_p", 0.25, 0.25), ("top_k", 3, 3), ("seed", 42, 42),
])
def test_set_sampling_fields_pass_through(field, value, internal):
    assert getattr(sampling_from_proto(pb.SamplingParams(**{field: value})), field) == internal


@pytest.mark.parametrize("field, message", [
    ("max_tokens", "max_tokens must be at least 1"),
    ("top_p", r"top_p must be in \(0, 1\]"),
])
def test_explicit_zero_is_refused_not_defaulted(field, message):
    unset = sampling_from_proto(pb.SamplingParams())
    unset.validate()
    explicit = sampling_from_proto(pb.SamplingParams(**{field: 0}))
    assert getattr(explicit, field) == 0 != getattr(unset, field)
    with pytest.raises(InvalidRequest, match=message):
        explicit.validate()


@pytest.mark.parametrize("field", ["temperature", "top_k", "seed"])
def test_explicit_zero_is_kept_where_zero_is_valid(field):
    explicit = sampling_from_proto(pb.SamplingParams(**{field: 0}))
    assert getattr(explicit, field) == 0
    explicit.validate()
    assert pb.SamplingParams(**{field: 0}).HasField(field) and not pb.SamplingParams().HasField(field)


def test_seed_zero_is_a_seed_not_none():
    assert sampling_from_proto(pb.SamplingParams(seed=0)).seed == 0
    assert sampling_from_proto(pb.SamplingParams()).seed is None


def test_presence_survives_the_wire():
    sent = pb.SamplingParams(max_tokens=0, top_p=0.0, stop=["\n"], stop_token_ids=[2], ignore_eos=True)
    got = sampling_from_proto(pb.SamplingParams.FromString(sent.SerializeToString()))
    assert got == SamplingParams(max_tokens=0, top_p=0.0, stop=("\n",), stop_token_ids=(2,), ignore_eos=True)


def test_has_seed_is_gone_and_reserved():
    fields = pb.SamplingParams.DESCRIPTOR.fields_by_name
    assert "has_seed" not in fields
    assert [fields[n].number for n in ("max_tokens", "temperature", "top_p", "top_k", "seed")] == [1, 2, 3, 4, 5]
    declared = descriptor_pb2.DescriptorProto()
    pb.SamplingParams.DESCRIPTOR.CopyToProto(declared)
    assert [(r.start, r.end) for r in declared.reserved_range] == [(9, 10)]
    assert list(declared.reserved_name) == ["has_seed"]


def test_usage_to_proto_copies_every_field():
    expected = {"prompt_tokens": 11, "completion_tokens": 5, "ttft_ms": 1.5, "queue_ms": 0.25,
                "prefill_worker": "prefill-0", "decode_worker": "decode-1", "prefill_ms": 2.5,
                "kv_transfer_ms": 0.75, "kv_transfer_bytes": 4096, "migrations": 2, "cached_tokens": 32,
                "kv_cached_blocks": 2, "kv_wait_ms": 0.5, "prefill_queue_ms": 1.25, "prefill_compute_ms": 3.5,
                "token_steps": "FKDI"}
    msg = usage_to_proto(Usage(**expected))
    assert {f.name: getattr(msg, f.name) for f in msg.DESCRIPTOR.fields} == expected
    assert usage_to_proto(Usage()) == pb.Usage()


def test_a_client_reads_each_finish_reason_as_its_text_and_an_abort_as_cancelled():
    assert [(r.value, r.public) for r in FinishReason] == [
        ("stop", "stop"), ("length", "length"), ("abort", "cancelled"), ("prefilled", "prefilled"), ("error", "error")]


def test_pool_status_to_proto():
    view = SimpleNamespace(pool="decode", target=3, ready=2, starting=1, restarts=4,
                           last_failure="decode-2 died: exit 9", last_failure_age_s=12.5)
    msg = pool_status_to_proto(view)
    assert {f.name: getattr(msg, f.name) for f in msg.DESCRIPTOR.fields} == vars(view)
    status = pb.StatusResponse(pools=[msg])
    assert pb.StatusResponse.FromString(status.SerializeToString()).pools[0] == msg
