"""Asynchronous save inside a training loop: what it costs the loop, against a synchronous save.

Trains ``bench/ckpt_io.py``'s model (``--layers`` x ``Linear(dim, dim)``, each layer and the
root ``fully_shard``-ed (ZeRO-3), AdamW) on random inputs. After a warm-up (one window with a
save, which allocates the staging buffer and is reported apart), each round times, in rotating
order: a synchronous ``mfsdp_ckpt.save`` of the same state; a window of ``--window`` training
steps without a save; and the same window right after ``mfsdp_ckpt.async_save``, ending with
``handle.result()`` (whatever the background write has not finished by then counts against the
window). Reports the medians over the rounds, the slowest rank's, of

- (a) ``call``: the seconds ``async_save`` kept the caller (the checks);
- (b) ``fence``: the seconds the optimizer step waited for the background copy;
- (c) ``slowdown``: the window with the save minus the window without, call included: the
  training time the save cost in all (the background copy and write compete with training for
  the CPU cores and memory bandwidth);

each against the synchronous save's time (targets: the blocking time a + b at most 5%, the
slowdown c at most 50%: an asynchronous save must cost training less than a synchronous one), and
the peak extra host memory of a rank (its peak RSS over the windows with a save minus its peak
RSS over a window without one, before the first async save) against the rank's state bytes
(target: at most 1.1x).

    .venv/bin/torchrun --standalone --nproc-per-node 2 bench/async_train.py --dir /tmp/async_bench
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from ckpt_io import (  # bench/ (the script's directory)
    build_state,
    local_tensors,
    reset_peak_rss,
    rss_kib,
    slowest,
    timed,
)
from torch import nn

import mfsdp_ckpt
from mfsdp_ckpt.sharded.async_save import staging_bytes


def train_step(model: nn.Module, optim: torch.optim.Optimizer, x: torch.Tensor) -> None:
    """One forward, backward and optimizer step."""
    model(x).float().square().mean().backward()
    optim.step()
    optim.zero_grad()


def _window(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    x: torch.Tensor,
    steps: int,
    save: Callable[[], mfsdp_ckpt.AsyncSaveHandle] | None,
) -> tuple[float, mfsdp_ckpt.AsyncSaveHandle | None]:
    """Seconds of ``save()`` (if any), ``steps`` training steps and waiting for the save's commit."""
    dist.barrier()
    start = time.perf_counter()
    handle = save() if save is not None else None
    for _ in range(steps):
        train_step(model, optim, x)
    if handle is not None:
        handle.result()
    return time.perf_counter() - start, handle


def median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def measure(
    path: str,
    model: nn.Module,
    optim: torch.optim.Optimizer,
    *,
    rounds: int,
    steps: int,
    batch: int,
    threads: int,
    clear: Callable[[str], None],
) -> dict[str, float]:
    """The numbers above (seconds; ``peak_extra``: bytes of this rank), saving to a fresh ``path``
    each time. ``clear(directory)`` empties the run directory (collective)."""
    dim = next(model.parameters()).shape[-1]
    x = torch.randn(batch, dim, generator=torch.Generator().manual_seed(dist.get_rank()))
    run = os.path.dirname(path)
    train_step(model, optim, x)  # warm: optimizer state, allocator
    reset_peak_rss()
    base_s, _ = _window(model, optim, x, steps, None)
    base_peak = rss_kib("VmHWM")

    def save() -> mfsdp_ckpt.AsyncSaveHandle:
        return mfsdp_ckpt.async_save(path, model, optim, thread_count=threads)

    clear(run)
    reset_peak_rss()
    first_s, first = _window(model, optim, x, steps, save)
    peak = rss_kib("VmHWM") - base_peak
    out: dict[str, list[float]] = {}
    for r in range(rounds):
        parts = ["sync", "without", "with"]
        for part in parts[r % 3 :] + parts[: r % 3]:  # rotate: the disk's and the CPUs' speed drift
            clear(run)
            if part == "sync":
                out.setdefault("sync", []).append(
                    timed(lambda: mfsdp_ckpt.save(path, model, optim, thread_count=threads))
                )
            elif part == "without":
                seconds, _ = _window(model, optim, x, steps, None)
                out.setdefault("without", []).append(slowest(seconds))
            else:
                reset_peak_rss()
                seconds, h = _window(model, optim, x, steps, save)
                peak = max(peak, rss_kib("VmHWM") - base_peak)
                for name, value in (
                    ("with", seconds),
                    ("call", h.call_s),
                    ("fence", h.fence_s),
                    ("blocked", h.blocked_s),
                    ("staged", h.staged_s),
                    ("total", h.total_s),
                ):
                    out.setdefault(name, []).append(slowest(value))
    result = {name: median(values) for name, values in out.items()}
    result["slowdown"] = median([w - wo for w, wo in zip(out["with"], out["without"])])
    result["without_min"], result["without_max"] = min(out["without"]), max(out["without"])
    result.update(
        step=slowest(base_s) / steps,
        first_call=slowest(first.call_s),
        first_fence=slowest(first.fence_s),
        first_slowdown=slowest(first_s) - result["without"],
        peak_extra=peak * 1024.0,
    )
    return result


def report(a: dict[str, float], ratio: float, rounds: int, steps: int, staging: float) -> str:
    """The lines that say it, with the targets (a + b <= 5% of sync; c <= 50% of sync; memory <= 1.1x)."""
    sync = a["sync"]

    def pct(x: float) -> str:
        return f"{x:.3f} s = {x / sync:5.1%}"

    met = "met" if a["blocked"] <= 0.05 * sync else "NOT met"
    slow_met = "met" if a["slowdown"] <= 0.5 * sync else "NOT met"
    return "\n".join(
        [
            (
                f"async_save in a training loop, median of {rounds} rounds, the slowest rank; a window = async_save + "
                f"{steps} training steps (one step: {a['step']:.2f} s) + waiting for the commit; against sync save {sync:.2f} s:"
            ),
            f"  (a) call (checks; blocks the caller)          {pct(a['call'])}",
            f"  (b) fence (the optimizer step waited)        {pct(a['fence'])}",
            f"  (a)+(b) blocked training                    {pct(a['blocked'])}  (target <= 5%: {met})",
            (
                f"  (c) slowdown of the window vs no save        {pct(a['slowdown'])}  (target <= 50%: {slow_met}; "
                f"median of the rounds' differences; windows {a['with']:.2f} s with vs {a['without']:.2f} s without a save, "
                f"which ranged {a['without_min']:.2f}-{a['without_max']:.2f} s: the noise; the background copy and write "
                f"compete with training for the cores)"
            ),
            (
                f"  copy done {a['staged']:.2f} s, commit {a['total']:.2f} s after the call; first save (allocates the "
                f"buffer): call {a['first_call']:.3f} s, fence {a['first_fence']:.3f} s, slowdown {a['first_slowdown']:.2f} s"
            ),
            (
                f"  peak extra host memory {ratio:.2f}x the rank's state bytes (target <= 1.1x: "
                f"{'met' if ratio <= 1.1 else 'NOT met'}; staging buffer {staging / 1e9:.2f} GB per rank)"
            ),
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/tmp/mfsdp_async_bench")
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=16, help="rows of the input per rank")
    parser.add_argument("--window", type=int, default=2, help="training steps per timed window")
    parser.add_argument("--threads", type=int, default=1, help="writer threads per rank for mfsdp_ckpt")
    parser.add_argument("--rounds", type=int, default=5, help="repetitions; the median is reported")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    if rank == 0:
        shutil.rmtree(args.dir, ignore_errors=True)
        os.makedirs(args.dir)
    model, optim = build_state(args.layers, args.dim)
    local_bytes = sum(t.numel() * t.element_size() for t in local_tensors(model, optim).values())

    def clear(path: str) -> None:
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        dist.barrier()

    a = measure(
        os.path.join(args.dir, "run", "step_1"),
        model,
        optim,
        rounds=args.rounds,
        steps=args.window,
        batch=args.batch,
        threads=args.threads,
        clear=clear,
    )
    ratio = torch.tensor([a["peak_extra"] / local_bytes], dtype=torch.float64)
    dist.all_reduce(ratio, op=dist.ReduceOp.MAX)
    total = torch.tensor([local_bytes], dtype=torch.float64)
    dist.all_reduce(total)
    if rank == 0:
        print(
            f"state: {total.item() / 1e9:.2f} GB over {dist.get_world_size()} ranks ({args.layers} x "
            f"Linear({args.dim},{args.dim}) + AdamW, ZeRO-3), batch {args.batch} rows per rank"
        )
        print(report(a, ratio.item(), args.rounds, args.window, staging_bytes()))
        shutil.rmtree(args.dir, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
