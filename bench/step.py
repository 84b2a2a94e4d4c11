"""Training step time and peak memory of our ZeRO-3 step against three baselines, in one run.

    .venv/bin/torchrun --standalone --nproc-per-node 2 bench/step.py --model tiny
    .venv/bin/torchrun --standalone --nproc-per-node 2 bench/step.py --model gpt50m --steps 2 --rounds 3
    .venv/bin/torchrun --standalone --nproc-per-node 4 bench/step.py --model tiny
    .venv/bin/torchrun --standalone --nproc-per-node 2 bench/step.py --model tiny --profile
    .venv/bin/torchrun --standalone --nproc-per-node 4 bench/step.py --model tiny --dp-replicate 2

What it measures. One training step (forward, cross-entropy, backward, ``optim.step()``,
``optim.zero_grad()``) of the same GPT (``mfsdp_core.models.gpt``, built with seed 0), the same
per-rank token batches, fp32, the same world size and the same ``reshard_after_forward``, in
four modes:

* ``ours``: every decoder layer and then the root ``mfsdp_core.fully_shard``-ed with
  ``optim_grads_params`` (ZeRO-3), AdamW under ``fully_shard_optimizer``;
* ``ours-sync``: ours with ``set_overlap(model, False)``: each unit gathered when it runs, each
  reduction completed before backward goes on (what prefetching and reductions in flight buy);
* ``fsdp2``: PyTorch's ``torch.distributed.fsdp.fully_shard`` on the same units, plain AdamW;
* ``ddp``: ``DistributedDataParallel`` over the whole model, AdamW;
* ``floor``: each rank trains its own whole copy with AdamW and no process-group call inside
  the step: what the step costs without any communication, with the cores shared as in the
  other modes (every rank computes on the same per-rank batch);
* ``ours-hsdp`` (with ``--dp-replicate R``): ours as HSDP, R replica groups of W / R ranks
  (``mfsdp_core.hsdp``: sharded inside a group, gradients all-reduced across the groups).

Method, time. Every model is built once up front. After ``--warmup`` untimed steps per mode,
each of ``--rounds`` rounds runs ``--steps`` steps of every mode, the mode order rotated by one
per round. Each mode's block starts after a ``dist.barrier()``; every step is timed on every
rank (after ``torch.cuda.synchronize()`` on GPU), and a step's time is that of its slowest rank.
The table gives the median (and min / max) over all timed steps of a mode, and the ratios of
each "ours" variant to every baseline (``ours/floor = 1.23x``: 1.23 times the floor's step time).
Batch k of rank r is the same in every mode (a generator seeded by r and k).

Method, peak memory. A CPU has no allocator peak counter, so after the timed rounds rank 0
launches, for each mode, a separate run of this script under torchrun with the same world size
(``--measure-memory MODE``) that builds only that mode. On CPU each rank of that run resets its
peak resident set size (``/proc/self/clear_refs`` ``5``) after process-group setup and a small
priming step (so that lazily created thread pools and the autograd engine are not charged to any
mode), and reports ``VmHWM`` minus the resident size at that point after building the model and
optimizer and running ``--warmup`` + 2 steps: the whole peak the mode adds to a process (weights,
gradients, optimizer state, communication buffers, activations, allocator slack). Where the
reset is refused it falls back to ``ru_maxrss`` minus the same baseline, an upper bound, and
says so. On CUDA it is ``torch.cuda.max_memory_allocated()`` after ``reset_peak_memory_stats()``,
minus what was allocated at the reset. The table shows the largest value over the ranks, in MiB.
``--no-memory`` skips these runs.

``--profile``: after the rounds, ``torch.profiler`` records 3 steps of ``ours`` and of
``floor``; rank 0 prints each mode's 15 ops with the most self CPU time, the self CPU time in
collectives and waits (op names with ``gloo``, ``nccl``, ``c10d``, ``record_param_comms``,
``all_gather``, ``reduce_scatter``, ``all_reduce``, ``broadcast``, ``wait``), and the ops on
which ours spends the most self CPU time more than the floor. Self CPU time sums over threads
(gloo runs collectives on threads of its own), so it can exceed the wall time.

On CPU with gloo every "rank" shares the same cores (``--threads``: intra-op threads per rank,
default: cores // world size): the numbers show what our runtime's step costs over the same
computation without communication, and over PyTorch's FSDP2 and DDP, on this machine, not GPU
speed.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mfsdp_core import fully_shard, fully_shard_optimizer, set_overlap
from mfsdp_core.hsdp import hsdp_groups, hsdp_placement
from mfsdp_core.models.gpt import GPTConfig, GPTModel, get_preset, shard_units
from mfsdp_core.plan import DEFAULT_GROUP, placement_fn

BASELINES = ("fsdp2", "ddp", "floor")
SYNC = "ours-sync"
MODES = ("ours", SYNC, *BASELINES)
HSDP = "ours-hsdp"
OURS_VARIANTS = ("ours", SYNC, HSDP)
PROFILE_MODES = ("ours", "floor")
PROFILE_STEPS = 3
MEMORY_STEPS = 2
TOP_OPS = 15
COMM_PATTERN = re.compile(
    r"gloo|nccl|c10d|record_param_comms|all_gather|allgather|reduce_scatter|all_reduce|allreduce|broadcast|wait",
    re.IGNORECASE,
)
MEMORY_TAG = "MEMORY"
# set by torchrun for its workers; a nested torchrun must not see them
_TORCHRUN_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_NAME",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)

Run = tuple[nn.Module, torch.optim.Optimizer]
Builder = Callable[[GPTConfig, argparse.Namespace, torch.device], Run]


# --------------------------------------------------------------------------------------------------
# Setup


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--model", choices=("tiny", "gpt50m"), default="tiny")
    p.add_argument("--seqs", type=int, default=2, help="sequences per rank and step")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    p.add_argument("--steps", type=int, default=5, help="timed steps per mode and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per mode before the rounds")
    p.add_argument("--modes", default=None, help=f"comma-separated subset of {', '.join((*MODES, HSDP))}")
    p.add_argument("--no-reshard-after-forward", dest="reshard_after_forward", action="store_false")
    p.add_argument("--threads", type=int, default=None, help="torch threads per rank (default: cores // world)")
    p.add_argument("--dp-replicate", type=int, default=0, help="R > 1 adds ours-hsdp: R replicas of W/R shards")
    p.add_argument("--profile", action="store_true", help="profile ours and floor after the rounds")
    p.add_argument("--no-memory", dest="memory", action="store_false", help="skip the peak-memory runs")
    p.add_argument("--measure-memory", metavar="MODE", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name in ("seqs", "seq_len", "steps", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def model_config(name: str, seq_len: int) -> GPTConfig:
    """The ``tiny`` preset, or a ~50M-parameter Llama-style GPT (hidden 640, 9 layers)."""
    if name == "tiny":
        base = get_preset("tiny")
    else:
        base = dataclasses.replace(
            get_preset("llama-like-small"),
            vocab_size=8192,
            hidden_size=640,
            num_layers=9,
            num_attention_heads=8,
            num_query_groups=2,
            kv_channels=80,
            ffn_hidden_size=1728,
        )
    return dataclasses.replace(base, seq_length=max(base.seq_length, seq_len))


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def init_distributed() -> tuple[int, int, torch.device]:
    """NCCL and this rank's GPU where there is one, gloo on CPU otherwise."""
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl")
        device = torch.device("cuda", local)
    else:
        dist.init_process_group("gloo")
        device = torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), device


def set_threads(args: argparse.Namespace, world: int) -> str:
    """Apply ``--threads``; a line saying what was chosen and why."""
    if args.threads is None:
        args.threads = max(1, cores() // world)
        why = f"default: {cores()} cores // {world} ranks"
    else:
        why = "--threads"
    torch.set_num_threads(args.threads)
    return f"{args.threads} torch thread(s) per rank ({why})"


# --------------------------------------------------------------------------------------------------
# The modes


def fresh_model(config: GPTConfig, device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return GPTModel(config).to(device)


def build_ours(config: GPTConfig, args: argparse.Namespace, device: torch.device, replicas: int = 1) -> Run:
    model = fresh_model(config, device)
    mesh, place = None, None
    if replicas > 1:
        mesh = {DEFAULT_GROUP: dist.group.WORLD, **hsdp_groups(replicas)}
        place = hsdp_placement(placement_fn(None, None))
    for unit in shard_units(model):  # each decoder layer, then the root
        fully_shard(
            unit,
            mesh=mesh,
            placement=place,
            strategy="optim_grads_params",
            reshard_after_forward=args.reshard_after_forward,
        )
    return model, fully_shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))


def build_fsdp2(config: GPTConfig, args: argparse.Namespace, device: torch.device) -> Run:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    model = fresh_model(config, device)
    for unit in shard_units(model):
        fsdp2_fully_shard(unit, mesh=mesh, reshard_after_forward=args.reshard_after_forward)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def build_ddp(config: GPTConfig, args: argparse.Namespace, device: torch.device) -> Run:
    from torch.nn.parallel import DistributedDataParallel

    model = fresh_model(config, device)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    return ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-4)


def build_floor(config: GPTConfig, args: argparse.Namespace, device: torch.device) -> Run:
    model = fresh_model(config, device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def build_sync(config: GPTConfig, args: argparse.Namespace, device: torch.device) -> Run:
    model, optim = build_ours(config, args, device)
    return set_overlap(model, False), optim


def build_hsdp(config: GPTConfig, args: argparse.Namespace, device: torch.device) -> Run:
    return build_ours(config, args, device, replicas=args.dp_replicate)


BUILDERS: dict[str, Builder] = {
    "ours": build_ours,
    SYNC: build_sync,
    HSDP: build_hsdp,
    "fsdp2": build_fsdp2,
    "ddp": build_ddp,
    "floor": build_floor,
}


def chosen_modes(args: argparse.Namespace) -> list[str]:
    if args.modes is None:
        names = [*MODES, HSDP] if args.dp_replicate > 1 else list(MODES)
    else:
        names = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in names if m not in (*MODES, HSDP)]
    if unknown:
        raise SystemExit(f"unknown mode(s) {', '.join(unknown)}; expected {', '.join((*MODES, HSDP))}")
    if HSDP in names and args.dp_replicate <= 1:
        raise SystemExit(f"mode {HSDP} needs --dp-replicate R with R > 1")
    return names


def builders_for(names: list[str], args: argparse.Namespace, world: int) -> dict[str, Builder]:
    """Mode name -> builder; a one-line exit where ``--dp-replicate`` does not divide the world."""
    if HSDP in names and world % args.dp_replicate:
        raise SystemExit(f"error: --dp-replicate {args.dp_replicate} does not divide the world size {world}")
    return {name: BUILDERS[name] for name in names}


def build_all(builders: dict[str, Builder], config: GPTConfig, args: argparse.Namespace, device: torch.device):
    """Mode name -> (model, optimizer)."""
    return {name: build(config, args, device) for name, build in builders.items()}


# --------------------------------------------------------------------------------------------------
# Steps and timing


def batch(rank: int, step: int, config: GPTConfig, args: argparse.Namespace, device: torch.device) -> torch.Tensor:
    """Rank ``rank``'s tokens for its ``step``-th step, the same in every mode."""
    gen = torch.Generator().manual_seed(1_000_003 * rank + step)
    return torch.randint(0, config.vocab_size, (args.seqs, args.seq_len + 1), generator=gen).to(device)


def train_step(run: Run, tokens: torch.Tensor) -> None:
    model, optim = run
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    loss.backward()
    optim.step()
    optim.zero_grad()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Stepper:
    """Runs each mode's steps on its own batch sequence (batch k for its k-th step)."""

    def __init__(self, runs: dict[str, Run], config: GPTConfig, args: argparse.Namespace, device: torch.device):
        self.runs, self.config, self.args, self.device = runs, config, args, device
        self.rank = dist.get_rank()
        self.done = dict.fromkeys(runs, 0)

    def step(self, mode: str) -> float:
        """One step of ``mode``; its seconds on this rank."""
        tokens = batch(self.rank, self.done[mode], self.config, self.args, self.device)
        self.done[mode] += 1
        sync(self.device)
        start = time.perf_counter()
        train_step(self.runs[mode], tokens)
        sync(self.device)
        return time.perf_counter() - start


def timed_rounds(stepper: Stepper, args: argparse.Namespace) -> dict[str, list[float]]:
    """Per mode, every timed step's seconds on this rank, rounds in rotated mode order."""
    modes = list(stepper.runs)
    for mode in modes:
        for _ in range(args.warmup):
            stepper.step(mode)
    times: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(args.rounds):
        for mode in modes[r % len(modes) :] + modes[: r % len(modes)]:
            dist.barrier()
            times[mode].extend(stepper.step(mode) for _ in range(args.steps))
    dist.barrier()
    return times


def slowest_rank(times: dict[str, list[float]]) -> dict[str, list[float]]:
    """Per mode and step, the largest time over the ranks."""
    every: list[dict[str, list[float]]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(every, times)
    return {m: [max(rank[m][i] for rank in every) for i in range(len(times[m]))] for m in times}


# --------------------------------------------------------------------------------------------------
# Peak memory (one mode per process: see the module docstring)


def rss_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def prime(device: torch.device) -> None:
    """A small forward, backward and AdamW step, so that lazily made thread pools, the autograd
    engine and the optimizer's code paths exist before the baseline is taken."""
    lin = nn.Linear(64, 64).to(device)
    opt = torch.optim.AdamW(lin.parameters(), lr=1e-4)
    lin(torch.randn(8, 64, device=device)).sum().backward()
    opt.step()
    opt.zero_grad()


def measure_memory(mode: str, config: GPTConfig, args: argparse.Namespace, device: torch.device) -> None:
    """Build ``mode`` alone, run ``--warmup`` + 2 steps, print (rank 0) the peak bytes it added."""
    rank, world = dist.get_rank(), dist.get_world_size()
    builders = builders_for([mode], args, world)
    prime(device)
    gc.collect()
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base, method = torch.cuda.memory_allocated(device), "cuda max_memory_allocated"
    else:
        exact = reset_peak_rss()
        base, method = rss_bytes("VmRSS"), "VmHWM after clear_refs" if exact else "ru_maxrss (upper bound)"
    runs = build_all(builders, config, args, device)
    if mode in runs:
        stepper = Stepper(runs, config, args, device)
        for _ in range(args.warmup + MEMORY_STEPS):
            stepper.step(mode)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) - base
    elif exact:
        peak = rss_bytes("VmHWM") - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    peaks = torch.tensor([peak if mode in runs else -1], dtype=torch.float64, device=device)
    dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(f"{MEMORY_TAG} {mode} {int(peaks.item())} {method}", flush=True)


def memory_argv(args: argparse.Namespace, mode: str) -> list[str]:
    argv = ["--model", args.model, "--seqs", str(args.seqs), "--seq-len", str(args.seq_len)]
    argv += ["--warmup", str(args.warmup), "--threads", str(args.threads), "--measure-memory", mode]
    if args.dp_replicate:
        argv += ["--dp-replicate", str(args.dp_replicate)]
    if not args.reshard_after_forward:
        argv.append("--no-reshard-after-forward")
    return argv


def memory_run(args: argparse.Namespace, mode: str, world: int) -> tuple[float | None, str]:
    """Peak bytes of ``mode`` from its own torchrun job (one node, ``world`` ranks), and the method."""
    env = {k: v for k, v in os.environ.items() if k not in _TORCHRUN_VARS and not k.startswith("TORCHELASTIC_")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
    cmd += [os.path.abspath(__file__), *memory_argv(args, mode)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    for line in done.stdout.splitlines():
        if line.startswith(f"{MEMORY_TAG} {mode} "):
            _, _, peak, method = line.split(" ", 3)
            return (float(peak) if float(peak) >= 0 else None), method
    tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
    return None, f"memory run failed (exit {done.returncode}): {' | '.join(tail)}"


# --------------------------------------------------------------------------------------------------
# Profile


def profile_mode(stepper: Stepper, mode: str) -> Any:
    """``torch.profiler`` over ``PROFILE_STEPS`` steps of ``mode`` (every rank runs them)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if stepper.device.type == "cuda" else [])
    dist.barrier()
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(PROFILE_STEPS):
            stepper.step(mode)
    wall = (time.perf_counter() - start) / PROFILE_STEPS
    dist.barrier()
    return prof.key_averages(), wall


def self_ms_per_step(averages: Any) -> dict[str, float]:
    return {e.key: e.self_cpu_time_total / 1e3 / PROFILE_STEPS for e in averages}


def print_profile(mode: str, averages: Any, wall: float) -> dict[str, float]:
    """Rank 0's top ops of ``mode`` by self CPU time, and its summary line; op -> ms per step."""
    print(f"\n--- profile: {mode}, rank 0, {PROFILE_STEPS} steps, sorted by self CPU time ---")
    print(averages.table(sort_by="self_cpu_time_total", row_limit=TOP_OPS))
    per_step = self_ms_per_step(averages)
    comm = {k: v for k, v in per_step.items() if COMM_PATTERN.search(k)}
    total, comm_ms = sum(per_step.values()), sum(comm.values())
    top = ", ".join(f"{k} {v:.1f}" for k, v in sorted(comm.items(), key=lambda kv: -kv[1])[:4]) or "none"
    print(
        f"summary {mode}: {wall * 1e3:.1f} ms/step wall under the profiler; self CPU {total:.1f} ms/step "
        f"over all threads, of which collectives/waits {comm_ms:.1f} ms ({100 * comm_ms / max(total, 1e-9):.0f}%): {top}"
    )
    return per_step


def print_profile_diff(ours: dict[str, float], floor: dict[str, float]) -> None:
    """The ops on which ours spends the most self CPU time more than the floor, per step."""
    diff = {k: ours.get(k, 0.0) - floor.get(k, 0.0) for k in set(ours) | set(floor)}
    print(f"\nwhere ours spends self CPU time that floor does not (ms/step, ours - floor; top {TOP_OPS}):")
    print(f"{'op':<60} {'ours':>9} {'floor':>9} {'extra':>9}")
    for k, d in sorted(diff.items(), key=lambda kv: -kv[1])[:TOP_OPS]:
        print(f"{k[:60]:<60} {ours.get(k, 0.0):>9.2f} {floor.get(k, 0.0):>9.2f} {d:>9.2f}")
    extra = sum(ours.values()) - sum(floor.values())
    comm = sum(v for k, v in ours.items() if COMM_PATTERN.search(k)) - sum(
        v for k, v in floor.items() if COMM_PATTERN.search(k)
    )
    print(f"summary ours-floor: {extra:+.1f} ms/step self CPU in all, of which collectives/waits {comm:+.1f} ms")


def run_profiles(stepper: Stepper) -> None:
    per_step: dict[str, dict[str, float]] = {}
    for mode in (m for m in PROFILE_MODES if m in stepper.runs):
        averages, wall = profile_mode(stepper, mode)
        if dist.get_rank() == 0:
            per_step[mode] = print_profile(mode, averages, wall)
    if dist.get_rank() == 0 and len(per_step) == 2:
        print_profile_diff(per_step["ours"], per_step["floor"])


# --------------------------------------------------------------------------------------------------
# Report


def mib(peak: float | None) -> str:
    return "n/a" if peak is None else f"{peak / 2**20:.1f}"


def print_table(times: dict[str, list[float]], peaks: dict[str, tuple[float | None, str]]) -> None:
    print(f"{'mode':<10} {'median ms':>10} {'min ms':>9} {'max ms':>9} {'steps':>6} {'peak MiB':>9}")
    for mode, ts in times.items():
        peak = peaks.get(mode, (None, ""))[0]
        print(
            f"{mode:<10} {statistics.median(ts) * 1e3:>10.2f} {min(ts) * 1e3:>9.2f} "
            f"{max(ts) * 1e3:>9.2f} {len(ts):>6} {mib(peak):>9}"
        )
    methods = sorted({m for _, m in peaks.values()})
    if methods:
        print("peak memory: " + "; ".join(methods))


def print_ratios(times: dict[str, list[float]], peaks: dict[str, tuple[float | None, str]]) -> None:
    med = {m: statistics.median(ts) for m, ts in times.items()}
    for ours in (v for v in OURS_VARIANTS if v in med):
        for base in (b for b in BASELINES if b in med):
            print(f"{ours}/{base} = {med[ours] / med[base]:.2f}x")
    for ours in (v for v in OURS_VARIANTS if peaks.get(v, (None,))[0]):
        line = [f"{ours}/{b} = {peaks[ours][0] / peaks[b][0]:.2f}x" for b in BASELINES if peaks.get(b, (None,))[0]]
        if line:
            print("peak memory " + ", ".join(line))


def headline(config: GPTConfig, params: int, args: argparse.Namespace, world: int, device: torch.device) -> str:
    comm = "nccl on GPU" if device.type == "cuda" else "gloo on CPU"
    return (
        f"W={world}, model {args.model} ({params:,} parameters: hidden {config.hidden_size}, "
        f"{config.num_layers} layers, vocab {config.vocab_size}), {args.seqs}x{args.seq_len} tokens per rank, fp32, "
        f"reshard_after_forward={args.reshard_after_forward}, {comm}; median over {args.rounds} rounds x "
        f"{args.steps} steps (slowest rank per step), {args.warmup} warm-up steps per mode"
    )


# --------------------------------------------------------------------------------------------------


def benchmark(config: GPTConfig, args: argparse.Namespace, device: torch.device, threads: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    say = (lambda s: print(s, flush=True)) if rank == 0 else (lambda s: None)
    with torch.device("meta"):
        params = sum(p.numel() for p in GPTModel(config).parameters())
    say(headline(config, params, args, world, device))
    say(threads)
    runs = build_all(builders_for(chosen_modes(args), args, world), config, args, device)
    say(f"modes: {', '.join(runs)}")
    stepper = Stepper(runs, config, args, device)
    times = slowest_rank(timed_rounds(stepper, args))
    if args.profile:
        run_profiles(stepper)
    runs.clear()
    stepper.runs.clear()
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        peaks = {m: memory_run(args, m, world) for m in times} if args.memory else {}
        print()
        print_table(times, peaks)
        print_ratios(times, peaks)


def main() -> None:
    args = parse_args()
    rank, world, device = init_distributed()
    threads = set_threads(args, world)
    config = model_config(args.model, args.seq_len)
    if args.measure_memory:
        measure_memory(args.measure_memory, config, args, device)
        dist.destroy_process_group()
    else:
        benchmark(config, args, device, threads)


if __name__ == "__main__":
    main()
