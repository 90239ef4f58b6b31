"""The device check's `kv_transfer` (microbench/device_check.py): a KV transfer between two processes
on the one device through the project's channel (kv_transfer: KVReceiver in one process, KVSender in
the other): device tensors in, bit-identical device tensors out, bytes/s on the wire."""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
import traceback

import torch


def _kv_pool(device: str, blocks: int, seed: int | None, dtype: torch.dtype) -> torch.Tensor:
    """SmolLM2's KV layout (30 layers, 3 KV heads of 64, blocks of 16) filled from `seed`
    on the host (the same bits in any process), or zeros."""
    shape = (blocks, 30, 2, 16, 3, 64)
    if seed is None:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)


def _kv_decode_side(device: str, blocks: int, dtype: torch.dtype, transfers: int, deadline_s: float,
                    rendezvous: mp.Queue, report: mp.Queue) -> None:
    """The receiving process: opens the channel, hands its rendezvous over, then checks every
    landed transfer bit for bit against the sender's blocks rebuilt from the same seed."""
    from kv_transfer import KVReceiver, KVTransferConfig

    try:
        pool = _kv_pool(device, blocks, None, dtype)
        want = _kv_pool(device, blocks, 1, dtype).view(torch.uint8)
        landed: queue.Queue = queue.Queue()
        dst = list(reversed(range(blocks)))  # scattered: block i lands in block n-1-i

        def complete(request_id: str, dst_ids: list[int], error: BaseException | None) -> None:
            # runs before the sender's future resolves, so the next transfer cannot race the check
            same = error is None and bool(torch.equal(pool[dst_ids].view(torch.uint8), want))
            pool.zero_()  # the next transfer must land again, not be found already there
            if pool.is_cuda:
                torch.cuda.synchronize(pool.device)  # zeroed before the channel's stream writes again
            landed.put({"request": request_id, "error": None if error is None else str(error),
                        "identical": same, "pool_device": str(pool.device)})

        receiver = KVReceiver(pool, "127.0.0.1", KVTransferConfig(timeout_s=deadline_s),
                              lambda rid, n, first=0: dst[first:first + n], complete)
        try:
            rendezvous.put(receiver.open_channel("prefill"))
            report.put(("decode", [landed.get(timeout=deadline_s) for _ in range(transfers)]))
        finally:
            receiver.shutdown(wait=True)
    except Exception:  # noqa: BLE001 - reported to the parent, which fails the check
        report.put(("decode", {"exception": traceback.format_exc(limit=4)}))


def _kv_prefill_side(device: str, blocks: int, dtype: torch.dtype, transfers: int, deadline_s: float,
                     rendezvous: mp.Queue, report: mp.Queue) -> None:
    """The sending process: joins the channel and sends all its blocks, one transfer at a time."""
    from kv_transfer import KVSender, KVTransferConfig

    try:
        pool = _kv_pool(device, blocks, 1, dtype)
        sender = KVSender(pool, KVTransferConfig(timeout_s=deadline_s))
        try:
            host, port, secret = rendezvous.get(timeout=deadline_s)
            sender.connect("decode", host, port, secret)
            results = []
            for i in range(transfers):
                result = sender.send("decode", f"r{i}", list(range(blocks))).result(timeout=deadline_s)
                results.append({"bytes": result.num_bytes, "seconds": result.seconds})
            report.put(("prefill", {"backend": sender.backend("decode"), "transfers": results,
                                    "pool_device": str(pool.device)}))
        finally:
            sender.shutdown(wait=True)
    except Exception:  # noqa: BLE001 - reported to the parent, which fails the check
        report.put(("prefill", {"exception": traceback.format_exc(limit=4)}))


def check_kv_transfer(device: torch.device, blocks: int, transfers: int, deadline_s: float = 90.0) -> dict:
    """`transfers` transfers of `blocks` blocks from a prefill process to a decode process on `device`;
    the result as device_check records it (an `error` key when it failed)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    ctx = mp.get_context("spawn")  # CUDA cannot be forked into a child
    rendezvous, report = ctx.Queue(), ctx.Queue()
    args = (str(device), blocks, dtype, transfers, deadline_s, rendezvous, report)
    procs = [ctx.Process(target=fn, args=args, daemon=True) for fn in (_kv_decode_side, _kv_prefill_side)]
    for p in procs:
        p.start()
    sides: dict[str, object] = {}
    end = time.monotonic() + deadline_s
    try:
        while len(sides) < 2:
            side, value = report.get(timeout=max(end - time.monotonic(), 0.1))
            sides[side] = value
    except queue.Empty:
        pass
    finally:
        for p in procs:
            p.join(timeout=max(end - time.monotonic(), 5.0))
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
    return _kv_result(sides, blocks, dtype)


def _kv_result(sides: dict, blocks: int, dtype: torch.dtype) -> dict:
    missing = [s for s in ("decode", "prefill") if s not in sides]
    if missing:
        return {"error": f"no report from the {' and '.join(missing)} process before the deadline", **sides}
    failed = {s: v["exception"] for s, v in sides.items() if isinstance(v, dict) and "exception" in v}
    if failed:
        return {"error": "; ".join(f"{s} process: {e.strip().splitlines()[-1]}" for s, e in failed.items()),
                "tracebacks": failed}
    sent, landed = sides["prefill"], sides["decode"]
    best = max(t["bytes"] / t["seconds"] for t in sent["transfers"])
    result = {"backend": sent["backend"], "dtype": str(dtype).removeprefix("torch."),
              "pool_devices": [sent["pool_device"], landed[0]["pool_device"]],
              "blocks": blocks, "bytes_per_transfer": sent["transfers"][0]["bytes"],
              "transfers": len(landed), "identical": all(o["identical"] for o in landed),
              "best_bytes_per_s": round(best), "seconds_per_transfer": [round(t["seconds"], 4) for t in sent["transfers"]]}
    errors = [o["error"] for o in landed if o["error"]]
    if errors or not result["identical"]:
        result["error"] = "; ".join(errors) or "the landed blocks differ from the sent ones"
    return result
