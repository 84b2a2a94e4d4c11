"""Cold ``mfsdp_ckpt.load`` alone, alternating with ``dd`` of the same files, on 2 ranks.

``bench/ckpt_io.py`` compares every reader once per round, each after its own write. This one
times only the load of one checkpoint (10 x Linear(4096) + AdamW, 2.01 GB by default), and a
``dd`` of each rank's data file in the same state: rounds alternate "dd, then load" and "load,
then dd", because on a VM a read right after a read of the same bytes can be served faster by
the host (a cache no in-guest page-cache drop clears). It prints every time, the medians, the
ratio, and how long a rank spent in the load's two passes (verify; copy into place)::

    .venv/bin/torchrun --standalone --nproc-per-node 2 bench/load_cold.py --dir /tmp/load_cold
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import subprocess
import time

import torch
import torch.distributed as dist
from ckpt_io import build_state  # bench/ (the script's directory)
from pagecache import drop_cache

import mfsdp_ckpt
import mfsdp_ckpt.read.dcp_reader as storage


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/tmp/mfsdp_load_cold")
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--threads", type=int, default=None, help="load(thread_count=N); default: load's own")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    if rank == 0:
        shutil.rmtree(args.dir, ignore_errors=True)
    dist.barrier()
    model, optim = build_state(args.layers, args.dim)
    path = os.path.join(args.dir, "run", "step_1")
    mfsdp_ckpt.save(path, model, optim)
    data_file = os.path.join(path, f"__{rank}_0.distcp")
    passes = {"verify": 0.0, "copy": 0.0}
    for name, fn in (("verify", "verify_chunks"), ("copy", "read_verified")):
        original = getattr(storage, fn)

        def timed_pass(*a, _original=original, _name=name, **k):
            start = time.perf_counter()
            try:
                return _original(*a, **k)
            finally:
                passes[_name] += time.perf_counter() - start

        setattr(storage, fn, functools.wraps(original)(timed_pass))

    def cold() -> None:
        if rank == 0:
            drop_cache(path)
        dist.barrier()

    def dd() -> float:
        cold()
        start = time.perf_counter()
        subprocess.run(["dd", f"if={data_file}", "of=/dev/null", "bs=1M"], check=True, capture_output=True)
        dist.barrier()
        return time.perf_counter() - start

    def load() -> float:
        cold()
        start = time.perf_counter()
        mfsdp_ckpt.load(path, model, optim, **({} if args.threads is None else {"thread_count": args.threads}))
        dist.barrier()
        return time.perf_counter() - start

    times: dict[str, list[float]] = {"dd": [], "load": []}
    for r in range(args.rounds):
        for name, fn in (("dd", dd), ("load", load)) if r % 2 == 0 else (("load", load), ("dd", dd)):
            times[name].append(fn())
    if rank == 0:
        med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
        for k, v in times.items():
            print(f"{k:5s} median {med[k]:.2f} s   rounds: {' '.join(f'{x:.2f}' for x in v)}")
        print(
            f"load vs dd: {med['dd'] / med['load']:.2f}x (>1: faster); rank 0 per load: "
            f"verify {passes['verify'] / args.rounds:.2f} s, copy into place {passes['copy'] / args.rounds:.2f} s"
        )
        shutil.rmtree(args.dir, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
