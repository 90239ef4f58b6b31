"""`pdserve` command line: serve, generate, status, scale, bench, plan.

The CLI only maps flags onto the config and the gRPC API. Usage and config errors print one
line naming the problem and exit 2; a failed RPC prints its status and exits 1.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from router import client
from router import plan as plan_cli
from router.bench import cli as bench_cli
from router.config import ClusterConfig, ConfigError, load_config

DEFAULT_CONFIG = "cluster.yaml"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except ConfigError as e:
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
    _add_status(sub)
    _add_scale(sub)
    bench_cli.add_parser(sub)
    plan_cli.add_parser(sub)
    return parser


def _router_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--router", metavar="HOST:PORT", help="a running router (default: the config's router)")
    p.add_argument("--config", default=DEFAULT_CONFIG, help="cluster.yaml, for the default router address")


def router_address(args: argparse.Namespace) -> str:
    if args.router:
        return args.router
    cfg = load_config(args.config) if Path(args.config).exists() else ClusterConfig()
    return f"{cfg.router.host}:{cfg.router.port}"


# ---- serve --------------------------------------------------------------------------
def _add_serve(sub) -> None:
    p = sub.add_parser("serve", help="start the cluster in the foreground (Ctrl-C to stop)")
    p.add_argument("--config", default=DEFAULT_CONFIG, help="cluster.yaml (default: %(default)s)")
    p.add_argument("--port", type=int, help="override router.port")
    p.add_argument("--log-level", default="INFO")
    p.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    import dataclasses

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = load_config(args.config)

    # heavy (torch, transformers, ray): imported once the config is known to be good
    from router.launcher import serve_forever

    if args.port is not None:
        cfg = dataclasses.replace(cfg, router=dataclasses.replace(cfg.router, port=args.port))
    t0 = time.perf_counter()

    def ready(cluster) -> None:
        shape = (f"{cfg.prefill.replicas} prefill + {cfg.decode.replicas} decode" if cfg.mode == "disaggregated"
                 else f"{cfg.decode.replicas} colocated")
        metrics = f", metrics on :{cluster.metrics_port}/metrics" if cluster.metrics_port else ""
        print(f"pdserve: ready in {time.perf_counter() - t0:.1f} s; router listening on {cluster.server.address} "
              f"({cfg.mode}: {shape} workers{metrics})", flush=True)

    serve_forever(cfg, ready)
    print("pdserve: stopped", flush=True)
    return 0


# ---- generate / status / scale ------------------------------------------------------
def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="stream a completion from a running router")
    p.add_argument("prompt")
    # unset sampling flags are left out of the request: the server's defaults apply
    p.add_argument("--max-tokens", type=int, help="default 16")
    p.add_argument("--temperature", type=float, help="default 0 (greedy)")
    p.add_argument("--top-p", type=float, help="default 1.0")
    p.add_argument("--top-k", type=int, help="default 0 (off)")
    p.add_argument("--seed", type=int, help="default none")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--usage", action="store_true", help="print token counts and timings at the end")
    _router_flag(p)
    p.set_defaults(func=_generate)


def _generate(args: argparse.Namespace) -> int:
    for name in ("max_tokens", "top_k"):
        if getattr(args, name) is not None and getattr(args, name) < 0:
            print(f"pdserve: error: --{name.replace('_', '-')} must be >= 0", file=sys.stderr)
            return 2
    last = None
    for msg in client.generate(router_address(args), args.prompt, max_tokens=args.max_tokens,
                               temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                               stop=args.stop, ignore_eos=args.ignore_eos):
        sys.stdout.write(msg.text)
        sys.stdout.flush()
        last = msg
    print()
    if args.usage and last is not None:
        u = last.usage
        print(f"[{last.finish_reason}] prompt {u.prompt_tokens} tokens, completion {u.completion_tokens} tokens, "
              f"TTFT {u.ttft_ms:.1f} ms, queue {u.queue_ms:.1f} ms, prefill {u.prefill_worker or '-'}, "
              f"decode {u.decode_worker}", file=sys.stderr)
    return 0


def _add_status(sub) -> None:
    p = sub.add_parser("status", help="pools, workers, KV blocks and channels of a running router")
    _router_flag(p)
    p.set_defaults(func=_status)


def _status(args: argparse.Namespace) -> int:
    print(client.format_status(client.status(router_address(args))))
    return 0


def _add_scale(sub) -> None:
    p = sub.add_parser("scale", help="grow or shrink a pool while it serves (shrinking drains)")
    p.add_argument("pool", choices=["prefill", "decode"])
    p.add_argument("replicas", type=int)
    _router_flag(p)
    p.set_defaults(func=_scale)


def _scale(args: argparse.Namespace) -> int:
    if args.replicas < 1:
        print("pdserve: error: replicas must be >= 1", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    resp = client.scale(router_address(args), args.pool, args.replicas)
    changes = [f"started {', '.join(resp.started)}"] if resp.started else []
    changes += [f"drained and stopped {', '.join(resp.stopped)}"] if resp.stopped else []
    print(f"{resp.pool} pool has {resp.replicas} workers ({'; '.join(changes) or 'no change'}) "
          f"after {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
