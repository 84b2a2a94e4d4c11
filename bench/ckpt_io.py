"""Checkpoint I/O benchmark: save and cold load of a ~2 GiB sharded state on 2 ranks.

Compares, in one run and on the same disk: raw ``dd`` copying this rank's state bytes (write
with fdatasync; cold read), stock DCP (``FileSystemWriter`` with default settings) on the same
per-rank tensors, ``torch.save`` / ``torch.load`` of each rank's tensors, and
``mfsdp_ckpt.save`` / ``load`` (both modes: the default all-or-nothing load, and ``atomic=False``,
read straight into place), and a raw read of dd's file by ``--raw-threads`` threads of
``os.preadv`` (no checks, nothing copied twice), cold and again from the page cache (warm: the
memory pass an all-or-nothing load adds, which with the faster raw read makes its floor). The faster of the two raw reads (``dd``'s one
stream, or the threads) is what the disk gave a plain reader in this run: the script prints how
far above stock DCP's cold read that is, i.e. how much room a load had. "Cold" means the files'
pages were dropped from the page cache (``posix_fadvise(DONTNEED)`` after an fsync) before reading.

Then ``mfsdp_ckpt.async_save`` inside a training loop of the same model (``bench/async_train.py``
says how), in rounds with ``mfsdp_ckpt.save`` (same disk, same time): the time the call blocks,
the time the optimizer step waits for the background copy, and the loop's slowdown over the
steps around the save against a loop without one, each against ``save``'s time (target for the
blocking: at most 5%), and the peak extra host memory of a rank against that rank's state bytes
(target: at most 1.1x).

    .venv/bin/torchrun --standalone --nproc-per-node 2 bench/ckpt_io.py --dir /tmp/ckpt_bench

Prints the median of several rounds (the order rotates each round), GB/s (1e9 bytes per second,
over the bytes of the whole state) and ratios to raw dd and to stock DCP (> 1: faster).

``dd`` copies a file holding the rank's own state bytes (written once, outside the timing, and
left in the page cache), not ``/dev/zero``: a virtual disk may store zeros specially. On the
development VM one test read 1 GiB of zeros back in 0.57-1.16 s against 0.99-1.66 s for random
bytes; in a full run of this script the two were equal (1.07 s and 1.01 s).

``--s3 s3://BUCKET`` compares instead, on an object store, ``mfsdp_ckpt.save`` / ``load`` with a
plain s3fs put / get of each rank's tensors serialized once (outside the timing) with
``torch.save``: the same bytes, without checksums, commit or the DCP layout. Against a local
S3 server (moto on loopback) this measures the client path (serialization, spooling, HTTP, the
server's own speed), not S3's::

    .venv/bin/python -m moto.server -H 127.0.0.1 -p 5056 >/dev/null 2>&1 &
    export AWS_ACCESS_KEY_ID=testing AWS_SECRET_ACCESS_KEY=testing AWS_DEFAULT_REGION=us-east-1
    export FSSPEC_S3_ENDPOINT_URL=http://127.0.0.1:5056
    sleep 3; .venv/bin/python -c "import fsspec; fsspec.filesystem('s3').mkdir('bench')"
    .venv/bin/torchrun --standalone --nproc-per-node 2 bench/ckpt_io.py --s3 s3://bench --layers 4 --dim 2048
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import numpy
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from pagecache import (
    drop_cache,  # bench/pagecache.py (the script's directory is on sys.path)
)
from torch import nn

import mfsdp_ckpt
from mfsdp_ckpt.sharded.async_save import staging_bytes as mfsdp_ckpt_staging_bytes
from mfsdp_core import describe_shards, fully_shard, fully_shard_optimizer


def timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def rss_kib(field: str) -> int:
    """``VmRSS`` (now) or ``VmHWM`` (peak) of this process, KiB."""
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.MULTILINE).group(1))


def reset_peak_rss() -> None:
    """Start ``VmHWM`` again from the current RSS (Linux: ``clear_refs`` value 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def time_async_saves(path: str, model, optim, rounds: int, threads: int, clear) -> dict[str, float]:
    """``mfsdp_ckpt.async_save`` inside a training loop of this model, in rounds with a synchronous
    ``save`` of the same state and the same training steps without a save (``bench/async_train.py``):
    the call's blocking time, the optimizer step's wait at the fence, the loop's slowdown, each
    against the synchronous save, and this rank's peak extra RSS (bytes)."""
    from async_train import measure  # bench/ (the script's directory)

    return measure(path, model, optim, rounds=rounds, steps=2, batch=16, threads=threads, clear=clear)


def build_state(layers: int, dim: int):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(dim, dim, bias=False) for _ in range(layers)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optim = fully_shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))
    model(torch.randn(2, dim)).sum().backward()
    optim.step()
    return model, optim


def local_tensors(model, optim) -> dict[str, torch.Tensor]:
    """This rank's shards as plain tensors (what the baselines save)."""
    rank = dist.get_rank()
    out = {}
    for ps in describe_shards(model, optim):
        out[f"r{rank}.{ps.fqn}.param"] = ps.main.tensor
        for k, fs in ps.optim.items():
            out[f"r{rank}.{ps.fqn}.{k}"] = fs.tensor
    return out


def write_state_bytes(tensors: dict[str, torch.Tensor], path: str) -> None:
    """Write the rank's tensors' bytes back to back (fsynced): the source of the dd reference, so
    that ``dd`` moves the same bytes as the savers."""
    with open(path, "wb") as f:
        for t in tensors.values():
            f.write(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
        f.flush()
        os.fsync(f.fileno())


def parallel_read(path: str, out: numpy.ndarray, threads: int, block: int = 8 << 20) -> None:
    """Read ``path`` into ``out`` with ``threads`` threads of ``os.preadv`` in ``block``-byte
    requests: the raw disk at a deeper queue than ``dd``'s one stream, with no checks and no
    second copy."""
    fd = os.open(path, os.O_RDONLY)
    try:
        with memoryview(out) as view:

            def one(offset: int) -> None:
                done, want = 0, min(block, len(out) - offset)
                while done < want:
                    n = os.preadv(fd, [view[offset + done : offset + want]], offset + done)
                    if n == 0:
                        raise EOFError(f"{path}: shorter than {len(out)} bytes")
                    done += n

            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(one, range(0, len(out), block)))
    finally:
        os.close(fd)


def targets_report(results: dict[str, float], raw: float) -> str:
    """The issue's targets against this run's medians: the non-atomic load against ``dd``'s read
    and stock DCP's, the all-or-nothing load against its floor (the faster raw read plus one
    memory pass: the bytes read again from the page cache), the save against stock DCP's."""
    dd_read, dcp_read = results["dd read (cold)"], results["stock DCP read (cold)"]
    direct, atomic = results["mfsdp_ckpt atomic=False read (cold)"], results["mfsdp_ckpt read (cold)"]
    floor = raw + results["page cache preadv read (warm)"]
    save = results["mfsdp_ckpt write"]
    rows = [
        f"load atomic=False: {dd_read / direct:.2f}x dd's read (target >= 0.9), {dcp_read / direct:.2f}x stock DCP (>= 1.5)",
        f"load atomic=True:  {atomic / floor:.2f}x its floor of {floor:.2f} s (raw read + page-cache pass; target <= 1.1), "
        f"{dcp_read / atomic:.2f}x stock DCP",
        f"save:              {results['stock DCP write'] / save:.2f}x stock DCP (target >= 1.3), {results['dd write'] / save:.2f}x dd",
    ]
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/tmp/mfsdp_ckpt_bench")
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=1, help="writer threads per rank for mfsdp_ckpt")
    parser.add_argument("--rounds", type=int, default=3, help="repetitions; the median is reported")
    parser.add_argument(
        "--raw-threads",
        type=int,
        default=8,
        help="threads per rank of the raw parallel read (no checks, no second copy)",
    )
    parser.add_argument(
        "--s3",
        default=None,
        metavar="URL",
        help="benchmark on this object-store prefix instead: mfsdp_ckpt vs plain s3fs put/get",
    )
    args = parser.parse_args()
    if args.s3:
        return s3_main(args)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    root = args.dir
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)
    model, optim = build_state(args.layers, args.dim)
    tensors = local_tensors(model, optim)
    local_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    total = torch.tensor([local_bytes], dtype=torch.float64)
    dist.all_reduce(total)
    total_bytes = total.item()
    stock_dir = os.path.join(root, "stock_dcp")
    ours_dir = os.path.join(root, "run", "step_1")
    dd_file = os.path.join(root, f"dd.{rank}")
    dd_source = os.path.join(root, f"dd_source.{rank}")
    ts_file = os.path.join(root, f"torch_save.{rank}.pt")
    write_state_bytes(tensors, dd_source)  # untimed; stays in the page cache
    targets = {k: torch.empty_like(v) for k, v in tensors.items()}
    raw_target = numpy.ones(local_bytes, dtype=numpy.uint8)  # its pages touched once, outside the timing

    def clear(path: str) -> None:
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        dist.barrier()

    def cold(path: str) -> None:
        if rank == 0 or os.path.isfile(path):
            drop_cache(path)
        dist.barrier()

    def torch_save() -> None:
        with open(ts_file, "wb") as f:
            torch.save(tensors, f)
            f.flush()
            os.fsync(f.fileno())

    # (name, prepare, timed action); each write is followed by its cold read
    pairs = [
        (
            "dd",
            lambda: None,
            lambda: subprocess.run(
                ["dd", f"if={dd_source}", f"of={dd_file}", "bs=1M", "conv=fdatasync"], check=True, capture_output=True
            ),
            lambda: cold(dd_file),
            lambda: subprocess.run(["dd", f"if={dd_file}", "of=/dev/null", "bs=1M"], check=True, capture_output=True),
        ),
        # reads the file dd wrote (dd comes first in round 0, and its file stays); no write of its own
        (
            f"raw preadv x{args.raw_threads}",
            lambda: None,
            None,
            lambda: cold(dd_file),
            lambda: parallel_read(dd_file, raw_target, args.raw_threads),
        ),
        (
            "torch.save/load",
            lambda: None,
            torch_save,
            lambda: cold(ts_file),
            lambda: torch.load(ts_file, weights_only=True),
        ),
        (
            "stock DCP",
            lambda: clear(stock_dir),
            lambda: dcp.save(tensors, storage_writer=dcp.FileSystemWriter(stock_dir)),
            lambda: cold(stock_dir),
            lambda: dcp.load(targets, storage_reader=dcp.FileSystemReader(stock_dir)),
        ),
        (
            "mfsdp_ckpt",
            lambda: clear(os.path.dirname(ours_dir)),
            lambda: mfsdp_ckpt.save(ours_dir, model, optim, thread_count=args.threads),
            lambda: cold(ours_dir),
            lambda: mfsdp_ckpt.load(ours_dir, model, optim),
        ),
        # reads the checkpoint the entry above wrote (it comes first in round 0, and its files stay)
        (
            "mfsdp_ckpt atomic=False",
            lambda: None,
            None,
            lambda: cold(ours_dir),
            lambda: mfsdp_ckpt.load(ours_dir, model, optim, atomic=False),
        ),
        # the memory pass an all-or-nothing load adds: the same bytes read again from the page cache
        (
            "page cache preadv",
            lambda: None,
            None,
            lambda: parallel_read(dd_file, raw_target, args.raw_threads),  # warm
            lambda: parallel_read(dd_file, raw_target, args.raw_threads),
        ),
    ]
    times: dict[str, list[float]] = {}
    for r in range(args.rounds):  # rotate the order: the disk's speed drifts with what ran before
        for name, prepare, write, make_cold, read in pairs[r % len(pairs) :] + pairs[: r % len(pairs)]:
            prepare()
            if write is not None:
                times.setdefault(f"{name} write", []).append(timed(write))
            make_cold()
            state = "warm" if name == "page cache preadv" else "cold"
            times.setdefault(f"{name} read ({state})", []).append(timed(read))
    results = {name: sorted(ts)[len(ts) // 2] for name, ts in times.items()}
    asynchronous = time_async_saves(ours_dir, model, optim, args.rounds, args.threads, clear)
    extra_ratio = torch.tensor([asynchronous["peak_extra"] / local_bytes], dtype=torch.float64)
    dist.all_reduce(extra_ratio, op=dist.ReduceOp.MAX)

    if rank == 0:
        print(
            f"state: {total_bytes / 1e9:.2f} GB over {world} ranks ({args.layers} x Linear({args.dim},{args.dim}) + AdamW), "
            f"median of {args.rounds} rounds; dd write uses fdatasync, reads are cold"
        )
        print(f"{'what':28s} {'seconds':>8s} {'GB/s':>7s} {'vs dd':>6s} {'vs DCP':>7s}")
        for name, seconds in results.items():
            kind = "read (cold)" if "read" in name else "write"  # the warm pass too: against the cold reads
            gbs = total_bytes / seconds / 1e9
            print(
                f"{name:28s} {seconds:8.2f} {gbs:7.2f} {results['dd ' + kind] / seconds:6.2f} {results['stock DCP ' + kind] / seconds:7.2f}"
            )
        raw = min(results["dd read (cold)"], results[f"raw preadv x{args.raw_threads} read (cold)"])
        dcp_read = results["stock DCP read (cold)"]
        print(
            f"stock DCP's cold read takes {dcp_read / raw:.2f}x the faster raw read ({raw:.2f} s); a load 1.5x faster "
            f"than DCP ({dcp_read / 1.5:.2f} s) would have to read {raw * 1.5 / dcp_read:.2f}x as fast as it"
        )
        print(targets_report(results, raw))
        from async_train import report  # bench/ (the script's directory)

        print(report(asynchronous, extra_ratio.item(), args.rounds, 2, mfsdp_ckpt_staging_bytes()))
        shutil.rmtree(root, ignore_errors=True)
    dist.destroy_process_group()


def s3_main(args: argparse.Namespace) -> None:
    """``--s3``: mfsdp_ckpt save / load vs a plain s3fs put / get of the same tensors' bytes."""
    import io

    from mfsdp_ckpt.storage import fs
    from mfsdp_ckpt.storage.remote import filesystem

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    root = fs.normalize(args.s3) + "/mfsdp_ckpt_bench"
    model, optim = build_state(args.layers, args.dim)
    buf = io.BytesIO()
    torch.save(local_tensors(model, optim), buf)
    payload = buf.getvalue()
    total = torch.tensor([len(payload)], dtype=torch.float64)
    dist.all_reduce(total)
    store, base = filesystem(root)
    plain = f"{base}/plain.{rank}"
    ours = f"{root}/run/step_1"

    def clear() -> None:
        if rank == 0 and fs.exists(f"{root}/run"):
            fs.remove_tree(f"{root}/run")
        dist.barrier()

    pairs = [
        ("s3fs put/get", lambda: None, lambda: store.pipe_file(plain, payload), lambda: store.cat_file(plain)),
        ("mfsdp_ckpt", clear, lambda: mfsdp_ckpt.save(ours, model, optim), lambda: mfsdp_ckpt.load(ours, model, optim)),
    ]
    times: dict[str, list[float]] = {}
    for r in range(args.rounds):
        for name, prepare, write, read in pairs[r % 2 :] + pairs[: r % 2]:
            prepare()
            times.setdefault(f"{name} write", []).append(timed(write))
            times.setdefault(f"{name} read", []).append(timed(read))
    results = {name: sorted(ts)[len(ts) // 2] for name, ts in times.items()}
    if rank == 0:
        print(
            f"state: {total.item() / 1e9:.3f} GB over {world} ranks on {args.s3} ({args.layers} x Linear({args.dim},{args.dim}) "
            f"+ AdamW), median of {args.rounds} rounds; measures the client path, not the store"
        )
        print(f"{'what':22s} {'seconds':>8s} {'GB/s':>7s} {'vs s3fs':>8s}")
        for name, seconds in results.items():
            kind = "read" if name.endswith("read") else "write"
            print(
                f"{name:22s} {seconds:8.2f} {total.item() / seconds / 1e9:7.3f} {results['s3fs put/get ' + kind] / seconds:8.2f}"
            )
        fs.remove_tree(root)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
