"""Offline reshard benchmark: ``mfsdp-ckpt reshard`` of a ~2 GiB checkpoint (4 → 3 ranks) against
``dd`` reading and writing the same bytes, in one run, with the peak RSS of the reshard process.

    .venv/bin/python bench/reshard.py --dir /tmp/reshard_bench

The source is written by ``mfsdp_ckpt.save`` on 4 gloo ranks (11 × Linear(4096, 4096) fp32 +
AdamW: 2.06 GiB of params and optimizer state; the largest tensor is 64 MiB). Reads are cold
(pages dropped with ``posix_fadvise(DONTNEED)`` first); writes are synced (dd: ``conv=fdatasync``;
reshard fsyncs each file). Median of ``--rounds`` rounds, order rotated. Cases: dd, reshard with
``--workers 1``, ``2``, and with no ``--workers`` (the default, ``default_workers``: one thread per
target file, at most 2 per CPU). Targets (issue 35): wall <= 1.1x dd with the default workers, more
workers never slower than one; peak RSS <= largest tensor + 512 MiB. The wall includes starting
Python and torch (about 1.5 s here).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from pagecache import drop_cache  # noqa: E402  (bench/pagecache.py; the script's directory is on sys.path)


def make_source(path: str, layers: int, dim: int) -> None:
    """Run on each torchrun rank: build, take one AdamW step, save."""
    import torch
    import torch.distributed as dist
    from torch import nn

    import mfsdp_ckpt
    from mfsdp_core import fully_shard, fully_shard_optimizer

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(dim, dim, bias=False) for _ in range(layers)])
    for layer in model:
        fully_shard(layer, policy="row")
    fully_shard(model, policy="row")
    optim = fully_shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))
    model(torch.randn(2, dim)).sum().backward()
    optim.step()
    mfsdp_ckpt.save(path, model, optim, extra={"step": 1}, update_latest=False)
    dist.destroy_process_group()


def data_files(path: str) -> list[str]:
    return sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".distcp"))


def run_child(cmd: list[str]) -> tuple[float, float]:
    """Wall seconds and peak RSS (MiB, the largest process of the child's tree) of ``cmd``."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}")
    return wall, usage.ru_maxrss / 1024


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default="/tmp/reshard_bench")
    p.add_argument("--layers", type=int, default=11)
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--target-world-size", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--make-source", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.make_source:
        make_source(args.make_source, args.layers, args.dim)
        return

    os.makedirs(args.dir, exist_ok=True)
    src = os.path.join(args.dir, "src")
    if not os.path.exists(src):
        subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node=4",
                os.path.abspath(__file__),
                "--make-source",
                src,
                "--layers",
                str(args.layers),
                "--dim",
                str(args.dim),
            ],
            check=True,
            cwd=ROOT,
        )
    total = sum(os.path.getsize(f) for f in data_files(src))
    largest_mib = args.dim * args.dim * 4 / 2**20

    def run_dd() -> tuple[float, float]:
        """dd reads every source file and writes it, synced."""
        out = os.path.join(args.dir, "dd")
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(out)
        drop_cache(src)
        start = time.perf_counter()
        for f in data_files(src):
            subprocess.run(
                ["dd", f"if={f}", f"of={os.path.join(out, os.path.basename(f))}", "bs=16M", "conv=fdatasync"],
                check=True,
                capture_output=True,
            )
        wall = time.perf_counter() - start
        shutil.rmtree(out)
        return wall, float("nan")

    def run_reshard(workers: int | None) -> tuple[float, float]:
        dst = os.path.join(args.dir, f"w{workers}")
        shutil.rmtree(dst, ignore_errors=True)
        drop_cache(src)
        flag = [] if workers is None else ["--workers", str(workers)]
        cmd = [sys.executable, "-m", "cli.main", "reshard", src, dst, "--world-size", str(args.target_world_size)]
        result = run_child(cmd + flag)
        shutil.rmtree(dst)
        return result

    default = max(1, min(args.target_world_size, 2 * (os.cpu_count() or 1), 4))  # reshard.default_workers
    cases = {
        "dd": run_dd,
        "reshard1": lambda: run_reshard(1),
        "reshard2": lambda: run_reshard(2),
        "default": lambda: run_reshard(None),
    }
    times: dict[str, list[float]] = {k: [] for k in cases}
    rss: dict[str, list[float]] = {k: [] for k in cases}
    names = list(cases)
    for r in range(args.rounds):  # rotate the order: the disk here is noisy and drifts
        for name in names[r % len(names) :] + names[: r % len(names)]:
            wall, peak = cases[name]()
            times[name].append(wall)
            rss[name].append(peak)
    med = {k: statistics.median(v) for k, v in times.items()}
    dd_wall = med["dd"]
    rows = [(str(w), med[k], max(rss[k])) for w, k in ((1, "reshard1"), (2, "reshard2"))]
    rows.append((f"default ({default})", med["default"], max(rss["default"])))

    baseline_rss = run_child([sys.executable, "-c", "import torch, mfsdp_ckpt.sharded.reshard"])[1]
    print(
        f"\nreshard {total / 2**30:.2f} GiB, 4 -> {args.target_world_size} ranks; largest tensor {largest_mib:.0f} MiB; "
        f"{os.cpu_count()} CPUs; median of {args.rounds} rounds (order rotated)"
    )
    print(f"{'':30s} {'wall s':>8s} {'GB/s':>6s} {'dd/ours':>8s} {'peak RSS MiB':>13s}")
    print(f"{'dd read+write (fdatasync)':30s} {dd_wall:8.2f} {total / dd_wall / 1e9:6.2f} {1.0:8.2f} {'-':>13s}")
    for workers, wall, peak in rows:
        print(
            f"{f'reshard --workers {workers}':30s} {wall:8.2f} {total / wall / 1e9:6.2f} {dd_wall / wall:8.2f} {peak:13.0f}"
        )
    print(
        f"\ntarget wall <= 1.1x dd with the default workers: ours/dd = {rows[2][1] / dd_wall:.2f} (default, "
        f"{default} workers), {rows[0][1] / dd_wall:.2f} (1 worker), {rows[1][1] / dd_wall:.2f} (2 workers)"
    )
    slower = [r[0] for r in rows[1:] if r[1] > rows[0][1]]
    print(f"more workers never slower than one: {'met' if not slower else 'MISSED (' + ', '.join(slower) + ')'}")
    print(
        f"target peak RSS <= largest tensor + 512 MiB = {largest_mib + 512:.0f} MiB: measured "
        f"{max(r[2] for r in rows):.0f} MiB "
        f"(python + torch + mfsdp_ckpt alone: {baseline_rss:.0f} MiB)"
    )


if __name__ == "__main__":
    main()
