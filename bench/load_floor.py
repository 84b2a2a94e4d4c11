"""What a load's all-or-nothing guarantee costs on this machine: the memory work of the ways to
move verified bytes from the page cache into place, without the disk (every file is in the page
cache), so that the disk's noise does not hide the difference.

``mfsdp_ckpt.load`` must leave the model unchanged when any chunk on any rank is bad, and no rank
knows that until every rank has verified everything. The ways to get there, each run by
``--procs`` processes at once (one per rank), each on its own ``--size-mib`` file:

* ``in place``: read straight into the destination and check the crc32c as blocks arrive. The
  floor: one copy by the kernel, one crc pass. It does not keep the guarantee (a bad chunk found
  late leaves the destination half-written).
* ``two passes`` (what ``load`` does): read and check through a reused 128 MiB area, then read the
  verified bytes again from the page cache into the destination: one more copy.
* ``undo log``: copy each block's old bytes aside, then read in place; a failure copies them back.
  The log is as large as the destination and is populated for the load.
* ``fresh memory``: read into new memory and swap it in after the agreement (the destination's
  storage replaced): no second copy, but every new page is faulted in and zeroed.
* ``fresh, huge pages``: the same, with the new memory advised to use 2 MiB pages.

Reported per way: the slowest process's seconds (median over ``--rounds``, ways in rotated order
each round) and the ratio to ``in place``. Memory copies and page faults are what this measures,
so the result depends on the cores per rank: on a machine with few cores per rank the second pass
is a large share of a cold load (compare with ``dd``'s time for the same bytes in
``bench/ckpt_io.py``)."""

from __future__ import annotations

import argparse
import mmap
import multiprocessing as mp
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import numpy

from mfsdp_ckpt.format.checksum import crc32c
from mfsdp_ckpt.read.staged_read import BLOCK_BYTES as BLOCK
from mfsdp_ckpt.read.staged_read import DEFAULT_READ_THREADS
from mfsdp_ckpt.read.staged_read import STAGE_BYTES as STAGE

WAYS = ["in place", "two passes", "undo log", "fresh memory", "fresh, huge pages"]


def _populated(size: int, huge: bool = False, populate: bool = True) -> numpy.ndarray:
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | (mmap.MAP_POPULATE if populate else 0)
    area = mmap.mmap(-1, size, flags=flags)
    if huge:
        area.madvise(mmap.MADV_HUGEPAGE)
    return numpy.frombuffer(area, dtype=numpy.uint8)


def _read(fd: int, out: numpy.ndarray, offset: int) -> None:
    done = 0
    with memoryview(out) as view:
        while done < len(out):
            n = os.preadv(fd, [view[done:]], offset + done)
            if n == 0:
                raise EOFError(f"short read at {offset + done}")
            done += n


def _one_way(way: str, path: str, threads: int) -> float:
    """Seconds to bring ``path`` into a destination the way ``way`` does (the destination's pages
    are touched before the clock starts, as a model's are)."""
    size = os.path.getsize(path)
    destination = _populated(size)
    destination.fill(1)
    fd = os.open(path, os.O_RDONLY)
    offsets = range(0, size, BLOCK)
    try:
        with ThreadPoolExecutor(threads) as pool:
            start = time.perf_counter()
            if way == "in place":

                def block(o: int) -> None:
                    _read(fd, destination[o : o + BLOCK], o)
                    crc32c(destination[o : o + BLOCK])

                list(pool.map(block, offsets))
            elif way == "two passes":
                stage = _populated(min(STAGE, size))
                slots = max(len(stage) // BLOCK, 1)

                def check(o: int) -> None:
                    slot = (o // BLOCK) % slots * BLOCK
                    buf = stage[slot : slot + min(BLOCK, size - o)]
                    _read(fd, buf, o)
                    crc32c(buf)

                list(pool.map(check, offsets))
                list(pool.map(lambda o: _read(fd, destination[o : o + BLOCK], o), offsets))
            elif way == "undo log":
                log = _populated(size)

                def logged(o: int) -> None:
                    numpy.copyto(log[o : o + BLOCK], destination[o : o + BLOCK])
                    _read(fd, destination[o : o + BLOCK], o)
                    crc32c(destination[o : o + BLOCK])

                list(pool.map(logged, offsets))
            else:
                fresh = _populated(size, huge=way == "fresh, huge pages", populate=False)

                def into_fresh(o: int) -> None:
                    _read(fd, fresh[o : o + BLOCK], o)
                    crc32c(fresh[o : o + BLOCK])

                list(pool.map(into_fresh, offsets))
            return time.perf_counter() - start
    finally:
        os.close(fd)


def _worker(way: str, path: str, threads: int, barrier, results) -> None:
    barrier.wait()
    results.put(_one_way(way, path, threads))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/tmp/mfsdp_load_floor")
    parser.add_argument("--size-mib", type=int, default=1024, help="bytes per process (rank)")
    parser.add_argument("--procs", type=int, default=2, help="processes at once, one per rank")
    parser.add_argument(
        "--threads", type=int, default=DEFAULT_READ_THREADS, help="threads per process (the load's default)"
    )
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    paths = [os.path.join(args.dir, f"rank{r}.bin") for r in range(args.procs)]
    rng = numpy.random.default_rng(0)
    for path in paths:
        if os.path.exists(path) and os.path.getsize(path) == args.size_mib << 20:
            continue
        with open(path, "wb") as f:
            for _ in range(args.size_mib // 64):
                f.write(rng.integers(0, 256, 64 << 20, dtype=numpy.uint8).tobytes())
    for path in paths:  # into the page cache
        with open(path, "rb") as f:
            while f.read(64 << 20):
                pass
    ctx = mp.get_context("spawn")
    seconds: dict[str, list[float]] = {way: [] for way in WAYS}
    for r in range(args.rounds):
        for way in WAYS[r % len(WAYS) :] + WAYS[: r % len(WAYS)]:
            barrier, results = ctx.Barrier(args.procs), ctx.Queue()
            procs = [ctx.Process(target=_worker, args=(way, p, args.threads, barrier, results)) for p in paths]
            for p in procs:
                p.start()
            times = [results.get() for _ in procs]
            for p in procs:
                p.join()
            seconds[way].append(max(times))
    base = statistics.median(seconds["in place"])
    print(
        f"{args.procs} processes x {args.size_mib} MiB from the page cache, {args.threads} threads each, "
        f"{os.cpu_count()} CPUs; slowest process, median of {args.rounds} rounds"
    )
    print(f"{'way':20s} {'seconds':>8s} {'vs in place':>12s}   all rounds")
    for way in WAYS:
        m = statistics.median(seconds[way])
        print(f"{way:20s} {m:8.3f} {m / base:11.2f}x   {' '.join(f'{s:.3f}' for s in seconds[way])}")


if __name__ == "__main__":
    main()
