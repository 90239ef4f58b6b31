"""The engine alone under `bench.peer`'s burst, scheduler settings side by side: the same prompts
(`bench.peer`'s workload: 32 requests, 16 at a time, 128-512 prompt tokens, 64 out, ids stable
under decode/encode), the same warm-up (its first 4 prompts, 8 tokens each: their prefixes are
cached when the run starts), and the served colocated @1x2 worker's engine config (whole prompts,
prefix caching on, 1 GiB of KV), one `LLMEngine` per setting, the settings taking turns each round.

Arrivals as served: a request that replaces a finished one reaches the engine `--arrival-ms` after
the step that finished its predecessor (the token's trip to the client and the new request's trip
back; ~30 ms measured on host E), and joins at the first step boundary after that, as a worker's
engine loop applies calls between steps; its TTFT counts from its arrival. A step in flight
therefore delays every request that arrives during it (docs/engine_speed.md, "The step's token
budget"). Reports TTFT p50, ITL p50 / p99 and output tokens/s, per setting the median over rounds,
and where the run's wall time went (`RunShape`): its decode-only steps (count, seconds, p50) and its
steps with prompt tokens (count, seconds, prompt tokens/s over them).

Settings: `--budget` (`max_num_batched_tokens`), `--partial` (`max_num_partial_prefills`, `none`:
no limit), `--chunk` (`chunk_size`, `none`: whole prompts), `--overlap` (`on`: a prompt step's
items start once what they read is done, the default; `off`: once the whole previous phase is,
`pd_team_overlap`); every combination.

    python -m microbench.schedule [--model models/smollm2-135m-instruct] [--dtype bfloat16]
        [--threads 2] [--budget 512,2048] [--partial none] [--chunk none] [--overlap on,off]
        [--arrival-ms 30] [--requests 32] [--concurrency 16] [--rounds 2] [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import itertools
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import yaml
from transformers import AutoTokenizer

from bench import peer, peer_servers
from bench.workload import RequestSpec
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from protocol.sampling import SamplingParams
from router.config.loader import parse_config
from sizing.cost_model import StepShape

WARM_UP = 4  # bench.peer's warm-up: its first prompts, 8 tokens each


def served_config(model: str, dtype: str) -> EngineConfig:
    """The engine config of `bench.peer`'s pdserve-colocated@1x2 worker."""
    with tempfile.TemporaryDirectory() as d:
        launch = peer_servers.pdserve_launch(model, "pdserve-colocated@1x2", dtype, 0, Path(d))
        cfg = parse_config(yaml.safe_load(Path(launch.cmd[launch.cmd.index("--config") + 1]).read_text()),
                           where="bench_peer")
    return cfg.engine_config(cfg.decode)


@dataclasses.dataclass
class RunShape:
    """A burst's steps by kind: decode-only (every item one token) or with prompt tokens; each
    step's wall time."""

    decode: list[float] = dataclasses.field(default_factory=list)
    prompt: list[float] = dataclasses.field(default_factory=list)
    prompt_tokens: int = 0

    def add(self, items: StepShape, seconds: float) -> None:
        """One step: `items` what it computed (`LLMEngine.last_step`)."""
        tokens = sum(it.num_tokens for it in items if not it.is_decode)
        (self.prompt if tokens else self.decode).append(seconds)
        self.prompt_tokens += tokens

    def as_dict(self) -> dict:
        prompt_s = sum(self.prompt)
        return {"decode_only_steps": len(self.decode), "decode_only_s": sum(self.decode),
                "decode_only_p50_s": statistics.median(self.decode) if self.decode else 0.0,
                "prompt_steps": len(self.prompt), "prompt_s": prompt_s,
                "prompt_tok_s": self.prompt_tokens / prompt_s if prompt_s else 0.0}


def burst(engine: LLMEngine, specs: list[RequestSpec], concurrency: int, arrival_s: float, tag: str) -> dict:
    """Run `specs` through `engine`, `concurrency` at a time, a replacement arriving `arrival_s`
    after the step that finished its predecessor; the latency figures in seconds."""
    pending, arrivals, order = list(specs), [], itertools.count()
    arrived, first, last, gaps, tokens, shape = {}, {}, {}, [], 0, RunShape()

    def arrive(at: float) -> None:
        spec = pending.pop(0)
        heapq.heappush(arrivals, (at, next(order), spec))

    def join(now: float) -> None:  # between steps: every request that has arrived
        while arrivals and arrivals[0][0] <= now:
            at, _, spec = heapq.heappop(arrivals)
            rid = f"{tag}-{spec.request_id}"
            arrived[rid] = at
            engine.add_request(rid, prompt_token_ids=list(spec.prompt_token_ids),
                               sampling=SamplingParams(max_tokens=spec.max_tokens, ignore_eos=True))

    t0 = time.perf_counter()
    for _ in range(min(concurrency, len(pending))):
        arrive(t0)
    while arrivals or engine.has_unfinished():
        join(time.perf_counter())
        if not engine.has_unfinished():
            time.sleep(max(0.0, arrivals[0][0] - time.perf_counter()))
            continue
        began = time.perf_counter()
        outs = engine.step()
        now = time.perf_counter()
        shape.add(engine.last_step, now - began)
        for o in outs:
            if not o.token_ids:
                continue
            tokens += len(o.token_ids)
            if o.request_id in first:
                gaps.append(now - last[o.request_id])
            else:
                first[o.request_id] = now - arrived[o.request_id]
            last[o.request_id] = now
            if o.finished and pending:
                arrive(now + arrival_s)
    wall = time.perf_counter() - t0
    return {"ttft_p50_s": statistics.median(first.values()), "itl_p50_s": statistics.median(gaps),
            "itl_p99_s": statistics.quantiles(gaps, n=100)[98], "output_tok_s": tokens / wall} | shape.as_dict()


def workload(tokenizer, args: argparse.Namespace, seed: int) -> list[RequestSpec]:
    wargs = peer.parse_args(["--model", args.model, "--peers", "", "--num-requests", str(args.requests),
                             "--concurrency", str(args.concurrency), "--output-len", str(args.max_tokens),
                             "--seed", str(seed)])
    return list(peer.make_workload_for(tokenizer, wargs).requests)


def measure(engines: dict[str, LLMEngine], args: argparse.Namespace, tokenizer,
            overlaps: dict[str, bool] | None = None) -> dict:
    """Each engine on each round's burst, taking turns; `overlaps`: the process-wide
    `pd_team_overlap` each engine's bursts run with (default: left as it is)."""
    rows = {name: [] for name in engines}
    kernels = next(iter(engines.values())).runner.forward.layer_kernel
    layer = kernels.layer if kernels is not None and overlaps is not None else None
    before = layer.team_overlap(True) if layer is not None else None
    try:
        for r in range(args.rounds):
            specs = workload(tokenizer, args, seed=r)
            warm = [dataclasses.replace(s, max_tokens=8) for s in specs[:WARM_UP]]
            for name in list(engines) if r % 2 == 0 else list(engines)[::-1]:
                engine = engines[name]
                if layer is not None:
                    layer.team_overlap(overlaps[name])
                engine.reset_cache()  # each setting starts from bench.peer's warm-up alone
                burst(engine, warm, WARM_UP, 0.0, f"w{r}")
                rows[name].append(burst(engine, specs, args.concurrency, args.arrival_ms / 1e3, f"r{r}"))
    finally:
        if layer is not None:
            layer.team_overlap(before)
    return {name: {key: round(statistics.median(row[key] for row in runs), 4) for key in runs[0]}
            | {"rounds": runs} for name, runs in rows.items()}


def _limit(text: str) -> int | None:
    return None if text == "none" else int(text)


def _values(text: str) -> list[str]:
    return text.split(",")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m microbench.schedule", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/smollm2-135m-instruct")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--budget", type=_values, default=["512"], help="max_num_batched_tokens values side by side")
    p.add_argument("--partial", type=_values, default=["none"],
                   help="max_num_partial_prefills values side by side (none: no limit)")
    p.add_argument("--chunk", type=_values, default=["none"], help="chunk_size values side by side (none: whole prompts)")
    p.add_argument("--overlap", type=_values, default=["on"],
                   help="pd_team_overlap values side by side (on: a prompt step's items start once what they "
                        "read is done; off: once the whole previous phase is)")
    p.add_argument("--arrival-ms", type=float, default=30.0,
                   help="a replacement request's arrival after the step that finished its predecessor")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    base = dataclasses.replace(served_config(args.model, args.dtype), torch_threads=args.threads)
    if set(args.overlap) - {"on", "off"}:
        p.error(f"--overlap takes on and off, not {args.overlap}")
    engines, overlaps = {}, {}
    for b, v, c, o in itertools.product(args.budget, args.partial, args.chunk, args.overlap):
        name = f"budget={b},partial={v},chunk={c}" + (f",overlap={o}" if len(args.overlap) > 1 else "")
        engines[name] = LLMEngine(dataclasses.replace(
            base, max_num_batched_tokens=int(b), max_num_partial_prefills=_limit(v), chunk_size=_limit(c)))
        overlaps[name] = o == "on"
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    report = {"model": args.model, "dtype": args.dtype, "threads": args.threads, "arrival_ms": args.arrival_ms,
              "settings": measure(engines, args, tokenizer, overlaps)}
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        for name, row in report["settings"].items():
            print(name, {k: v for k, v in row.items() if k != "rounds"})


if __name__ == "__main__":
    main()
