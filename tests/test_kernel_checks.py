"""The CPU kernels' boundary (engine/kernels/kernel_checks.py): every kernel, fed a bad value, raises a clear
error naming it before C runs (also under `python -O`); a short block table is refused, never padded
into another request's blocks; a cached library someone else could have written is rebuilt or refused."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.forward import attention, kernel_layer
from engine.kernels import kernel_build
from engine.kernels.cpu_ops import KernelUnavailable
from engine.kernels.kernel_checks import KernelArgumentError
from engine.request import Request, ScheduledItem
from protocol.sampling import SamplingParams
from tests.kernel_util import KERNELS

ROOT = Path(__file__).resolve().parent.parent
BLOCKS, BS, KVH, HEADS, DIM = 8, 4, 2, 6, 16


def _decode_args(**change):
    pool = torch.randn(BLOCKS, 2, BS, KVH, DIM)
    args = dict(query=torch.randn(2, HEADS, DIM), k_cache=pool[:, 0], v_cache=pool[:, 1],
                tables=torch.tensor([[3, 5, -1], [1, 2, 7]]), lens=torch.tensor([6, 11]),
                out=torch.empty(2, HEADS, DIM), scale=0.25, window=0, softcap=0.0)
    args.update(change)
    return args


def test_good_decode_arguments_run():
    args = _decode_args()
    KERNELS.decode(**args)
    assert torch.isfinite(args["out"]).all()


@pytest.mark.parametrize("change, message", [
    (dict(tables=torch.tensor([[3, 5, -1], [1, 2, 8]])), r"block id 8 in row 1 outside the pool's 8 blocks"),
    (dict(tables=torch.tensor([[3, -1, -1], [1, 2, 7]])), r"block id -1 in row 0 outside the pool's 8 blocks \(a table shorter than its row's length"),
    (dict(lens=torch.tensor([6, 13])), r"a row of length 13 > its table's 3 blocks x 4 keys"),
    (dict(lens=torch.tensor([0, 11])), r"a row of length 0"),
    (dict(lens=torch.tensor([6, 11, 2])), r"2 query rows, \(3,\) lens"),
    (dict(tables=torch.tensor([[3, 5, 0], [1, 2, 7]], dtype=torch.int32)), r"tables and lens must be int64"),
    (dict(query=torch.randn(2, 5, DIM), out=torch.empty(2, 5, DIM)), r"5 query heads are no multiple of 2 KV heads"),
    (dict(query=torch.randn(2, HEADS, DIM, dtype=torch.float16), out=torch.empty(2, HEADS, DIM, dtype=torch.float16)),
     r"of one dtype, float32 or bfloat16"),
    (dict(query=torch.randn(2, DIM, HEADS).transpose(1, 2)), r"head dim of query, caches and out must be contiguous"),
    (dict(out=torch.empty(2, HEADS, DIM + 1)), r"query \(2, 6, 16\) and out \(2, 6, 17\)"),
    (dict(v_cache=torch.randn(BLOCKS, BS, KVH, DIM)), r"k_cache .* and v_cache .* views alike"),
])
def test_the_decode_kernel_refuses_a_bad_value_by_name(change, message):
    with pytest.raises(KernelArgumentError, match=message):
        KERNELS.decode(**_decode_args(**change))


def test_a_table_written_after_its_check_is_checked_again():
    """The kernel checks a step's tables once for all its layers; changed in place, they are new."""
    args = _decode_args()
    KERNELS.decode(**args)
    args["tables"][1, 2] = BLOCKS + 3
    with pytest.raises(KernelArgumentError, match=r"block id 11 in row 1"):
        KERNELS.decode(**args)


@pytest.mark.parametrize("table, first_pos, message", [
    ([1, 2], 3, r"a table of 2 blocks for keys up to position 10, which need 3 blocks of 4"),
    ([1, 2, 9], 3, r"prefill kernel: block id 9 outside the pool's 8 blocks"),
    ([1, -2, 3], 3, r"prefill kernel: block id -2"),
])
def test_the_prefill_kernel_refuses_a_short_table_or_a_block_outside_the_pool(table, first_pos, message):
    pool = torch.randn(BLOCKS, 2, BS, KVH, DIM)
    query, out = torch.randn(8, HEADS, DIM), torch.empty(8, HEADS, DIM)
    with pytest.raises(KernelArgumentError, match=message):
        KERNELS.prefill(query, pool[:, 0], pool[:, 1], torch.tensor(table), first_pos, out, 0.25, 0, 0.0)


def test_the_small_kernels_refuse_bad_shapes_and_dtypes():
    x = torch.randn(3, 64)
    with pytest.raises(KernelArgumentError, match=r"rope: rows of 64 hold no 5 heads of 16"):
        KERNELS.rope(x, 5, 16, torch.randn(3, 16), torch.randn(3, 16))
    with pytest.raises(KernelArgumentError, match=r"rope: cos/sin torch.bfloat16, x torch.float32"):
        KERNELS.rope(x, 4, 16, torch.randn(3, 16).bfloat16(), torch.randn(3, 16).bfloat16())
    with pytest.raises(KernelArgumentError, match=r"rms_norm: weight must be \[64\] contiguous torch.float32"):
        KERNELS.rms_norm(x, torch.ones(63), 1e-6)
    with pytest.raises(KernelArgumentError, match=r"rms_norm: x: dtype torch.float16"):
        KERNELS.rms_norm(x.half(), torch.ones(64).half(), 1e-6)
    with pytest.raises(KernelArgumentError, match=r"add rms_norm: x \(3, 64\) and y \(2, 64\) differ"):
        KERNELS.rms_norm.add(x, torch.randn(2, 64), torch.ones(64), 1e-6)
    with pytest.raises(KernelArgumentError, match=r"silu_mul: gate\|up rows of odd width 63"):
        KERNELS.silu_mul(torch.randn(3, 63))
    with pytest.raises(KernelArgumentError, match=r"argmax: x: a matrix with contiguous rows"):
        KERNELS.argmax(torch.randn(64, 3).t())
    with pytest.raises(KernelArgumentError, match=r"argmax: x: dtype torch.int64"):
        KERNELS.argmax(torch.ones(2, 3, dtype=torch.int64))


def test_the_gemms_refuse_short_panels_and_wrong_dtypes():
    weight = torch.randn(40, 64)
    panels = KERNELS.gemm.pack(weight)
    with pytest.raises(KernelArgumentError, match=r"small gemm: panels: 3072 elements, needs 16384 contiguous"):
        KERNELS.gemm(torch.randn(2, 64), panels, None, 256)
    with pytest.raises(KernelArgumentError, match=r"small gemm: bias: 8 elements, needs 40"):
        KERNELS.gemm(torch.randn(2, 64), panels, torch.zeros(8), 40)
    with pytest.raises(KernelArgumentError, match=r"small gemm: x: dtype torch.bfloat16"):
        KERNELS.gemm(torch.randn(2, 64).bfloat16(), panels, None, 40)
    with pytest.raises(KernelArgumentError, match=r"small gemm pack: a float32 \[N, K\] weight"):
        KERNELS.gemm.pack(weight.double())
    with pytest.raises(KernelArgumentError, match=r"AMX gemm: 257 rows, more than the 256 a call takes"):
        KERNELS.amx_gemm(torch.randn(257, 64).bfloat16(), panels, None, 40)
    with pytest.raises(KernelArgumentError, match=r"AMX pack: a bfloat16 \[N, K\] weight"):
        KERNELS.amx_gemm.pack(weight)


def test_the_layer_kernels_step_checks_its_slots_and_tables_once():
    kv = torch.zeros(BLOCKS, 2, 2, BS, KVH, DIM)  # [blocks, layers, K|V, block_size, KVH, D]
    rows = attention.DecodeRows(KERNELS.decode, torch.tensor([[3, 5]]), torch.tensor([6]))
    meta = attention.StepMetadata(kv, torch.tensor([8]), torch.tensor([1]), [], [], decode_rows=rows)
    with pytest.raises(KernelArgumentError, match=r"KV write: block id 8 outside the pool's 8 blocks"):
        kernel_layer._check_step(meta)
    meta.slot_blocks, meta.slot_offsets = torch.tensor([5]), torch.tensor([4])
    with pytest.raises(KernelArgumentError, match=r"KV write: slot offset 4 outside a block of 4"):
        kernel_layer._check_step(meta)
    meta.slot_offsets = torch.tensor([1])
    shape = kernel_layer.Shape(hidden=HEADS * DIM, heads=HEADS, kv_heads=KVH + 1, dim=DIM, inter=8)
    cos = torch.zeros(1, 1, DIM)
    with pytest.raises(KernelArgumentError, match=r"a pool of \(2, 16\) KV heads x dims for layers of \(3, 16\)"):
        kernel_layer._build_step(meta, shape, cos, cos)
    rows.lens[0] = 9
    with pytest.raises(KernelArgumentError, match=r"a row of length 9 > its table's 2 blocks x 4 keys"):
        kernel_layer._check_step(meta)


def test_a_request_short_of_blocks_is_refused_not_padded(llama_dir):
    """The engine's tables for the decode kernel: a row with fewer blocks than its keys need is an
    error naming the request (it was padded with block 0, another request's, before)."""
    from engine.config import EngineConfig
    from engine.model_runner import ModelRunner

    runner = ModelRunner(EngineConfig(model_path=llama_dir, dtype="float32", num_blocks=16, block_size=4,
                                      cpu_kernels="on"))
    request = Request("r-short", list(range(10, 20)), SamplingParams(), detokenizer=None, block_ids=[4, 6],
                      num_computed_tokens=9)  # 10 keys with its new one: 3 blocks of 4 needed
    with pytest.raises(RuntimeError, match=r"request r-short has 2 KV blocks of 4, fewer than its 10 keys need"):
        runner._decode_rows([ScheduledItem(request, 1)])
    request.block_ids.append(9)
    rows = runner._decode_rows([ScheduledItem(request, 1), ScheduledItem(Request(
        "r-one", [5], SamplingParams(), detokenizer=None, block_ids=[2]), 1)])
    assert rows.tables.tolist() == [[4, 6, 9], [2, -1, -1]]  # padding no kernel reads, and no block's id


def test_the_checks_hold_under_python_o():
    script = ("import torch; from engine.kernels import cpu_kernel\n"
              "k, why = cpu_kernel.load(); pool = torch.zeros(4, 2, 4, 1, 16)\n"
              "k.decode(torch.zeros(1, 1, 16), pool[:, 0], pool[:, 1], torch.tensor([[9]]), torch.tensor([3]),"
              " torch.zeros(1, 1, 16), 1.0, 0, 0.0)\n")
    done = subprocess.run([sys.executable, "-O", "-c", script], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 1 and "KernelArgumentError: decode kernel: block id 9 in row 0 outside the pool's 4 " \
                                    "blocks" in done.stderr, done.stderr[-2000:]


# ---- the cached library -------------------------------------------------------------------
@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """A cache of its own, for a library of one small source (the cache's rules, without the kernels' build time)."""
    monkeypatch.setenv("PDSERVE_KERNEL_CACHE", str(tmp_path / "kernels"))
    monkeypatch.setattr(kernel_build, "SOURCES", (kernel_build.CSRC / "isa.c",))
    monkeypatch.setattr(kernel_build, "HEADERS", ())
    return tmp_path / "kernels"


def test_a_cached_library_others_could_write_is_rebuilt(cache):
    cc = kernel_build.compiler()
    built = kernel_build.build(cc)
    assert kernel_build.untrusted(built) == "" and kernel_build.untrusted(cache) == ""
    built.write_bytes(b"not the kernels")  # what a group member could have put there
    built.chmod(0o775)
    assert kernel_build.build(cc) == built
    assert kernel_build.untrusted(built) == "" and built.read_bytes() != b"not the kernels"


def test_a_cached_library_of_another_owner_is_distrusted(cache):
    built = kernel_build.build(kernel_build.compiler())
    owner = built.stat().st_uid
    assert kernel_build.untrusted(built, uid=owner + 1) == f"{built} is owned by uid {owner}, not this user ({owner + 1})"
    link = cache / "link.so"
    link.symlink_to(built)
    assert kernel_build.untrusted(link) == f"{link} is a symbolic link"
    if os.geteuid() == 0:  # root can hand the file to someone else: then it is rebuilt as this user's
        os.chown(built, 65534, 65534)
        assert kernel_build.build(kernel_build.compiler()) == built and built.stat().st_uid == 0


def test_a_cache_directory_others_can_write_is_refused(cache):
    cache.mkdir()
    cache.chmod(0o777)
    with pytest.raises(KernelUnavailable, match=r"refusing the kernel cache: .* writable by group or others "
                                                r"\(mode 777\); set PDSERVE_KERNEL_CACHE to a directory only"):
        kernel_build.build(kernel_build.compiler())

