"""MXFP8 cast benchmark: the native CPU kernel (``csrc/mx_cast.cpp``) against the pure-PyTorch
reference (``mfsdp_core.mx.quantize_reference``), both orientations, E4M3 floor and rceil.

    .venv/bin/python bench/mx_cast.py                          # 4096x1024 and 8192x4096, ~1 min
    .venv/bin/python bench/mx_cast.py --sizes 1024x1024 --threads 1

Throughput is GB/s of float32 input read (M * K * 4 bytes per cast), the best of ``--repeat``
timed calls after one warm-up (the first native call builds the kernel if it is not cached yet;
that build is not timed). Both sides use torch's intra-op threads (``--threads``, default all).
Each native result is checked byte for byte against the reference before it is timed.

One run; prints a table and the ratio native / reference.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from mfsdp_core import mx, mx_native  # noqa: E402


def _best(fn, repeat: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="4096x1024,8192x4096", help="comma-separated MxK")
    p.add_argument("--rules", default="floor,rceil")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    t = time.perf_counter()
    if mx_native.load("cpu") is None:
        sys.exit(f"native kernel unavailable: {mx_native.unavailable_reason('cpu')}")
    print(
        f"native kernel ready in {time.perf_counter() - t:.1f} s ({mx_native.build_dir('cpu')}); "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    print(f"{'shape':>11} {'format':>17} {'axis':>4} {'reference GB/s':>15} {'native GB/s':>12} {'native/ref':>11}")
    torch.manual_seed(0)
    for size in args.sizes.split(","):
        m, k = (int(v) for v in size.lower().split("x"))
        x = torch.randn(m, k)
        gb = x.numel() * 4 / 1e9
        for rule in args.rules.split(","):
            fmt = mx.MXFormat("e4m3", rule)
            for axis in mx.AXES:
                ref = mx.quantize_reference(x, fmt, axis)
                nat = mx.quantize(x, fmt, axis, backend="native")
                assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(ref, nat)), (
                    "bytes differ"
                )
                del ref, nat
                t_ref = _best(lambda x=x, fmt=fmt, axis=axis: mx.quantize_reference(x, fmt, axis), args.repeat)
                t_nat = _best(lambda x=x, fmt=fmt, axis=axis: mx.quantize(x, fmt, axis, backend="native"), args.repeat)
                print(
                    f"{size:>11} {str(fmt):>17} {axis:>4} {gb / t_ref:>15.2f} {gb / t_nat:>12.2f} {t_ref / t_nat:>10.1f}x"
                )


if __name__ == "__main__":
    main()
