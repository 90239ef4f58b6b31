"""Write a deterministic random-weight checkpoint with its tokenizer; see checkpoints/tiny.py.

    python -m checkpoints.make_tiny_model --arch llama --size tiny --out models/tiny-llama
"""

from __future__ import annotations

import argparse
import sys
import time

from checkpoints.tiny import ARCHS, SIZES, make_tiny_model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", choices=ARCHS, default="llama")
    parser.add_argument("--size", choices=tuple(SIZES), default="tiny")
    parser.add_argument("--out", required=True, help="checkpoint directory (created if missing)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    start = time.perf_counter()
    out = make_tiny_model(args.out, arch=args.arch, size=args.size, seed=args.seed)
    print(f"wrote {args.arch}/{args.size} seed {args.seed} to {out} in {time.perf_counter() - start:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
