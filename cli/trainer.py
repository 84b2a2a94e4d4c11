"""The trainer proper, run by each rank (:func:`run`; ``cli.train`` is its light front end): resumable
sharded training, launched by torchrun, of the reference GPT, a Hugging Face
``transformers`` causal LM (``--hf-model``) or a Megatron-Core ``GPTModel`` (``--mcore-config``):

    torchrun --standalone --nproc-per-node 2 -m cli.train --model tiny-moe --steps 60 \\
        --stop-at 30 --ckpt-dir ckpts/run1 --save-every 10
    torchrun --standalone --nproc-per-node 3 -m cli.train --model tiny-moe --steps 60 \\
        --ckpt-dir ckpts/run1 --resume
    torchrun --standalone --nproc-per-node 2 -m cli.train --model tiny --steps 60 \\
        --init-from ckpts/from_hf    # weights only (e.g. from ``mfsdp-ckpt import-hf``), fresh optimizer

Every decoder layer and then the root are ``fully_shard``-ed; AdamW (or Muon) steps on the local fp32
shards. The data (a synthetic stream, or ``--data``: a memory-mapped token file) is deterministic and
seekable, and its position is checkpointed, so a resumed run (at any world size) continues the same
sample sequence; at the same world size it is bitwise identical to an uninterrupted run. The model
(``cli.model_source``) is a preset, a ``--model-config`` file, an ``--hf-model`` directory, an
``--mcore-config`` file, or the one recorded in the checkpoint the run starts from. gloo on CPU by
default; NCCL when CUDA is available.

This module is the application on top of both packages (the runtime ``mfsdp_core`` and the
checkpoint layer ``mfsdp_ckpt``), which is why it lives next to the command line: neither package
imports it, and the runtime never imports the checkpoint layer.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import resource
import signal
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import mfsdp_ckpt
from mfsdp_ckpt.errors import shown_list
from mfsdp_ckpt.read.manifest import read_manifest
from mfsdp_ckpt.storage import fs as mfsdp_fs
from mfsdp_ckpt.storage.objstore import check_writable_prefix
from mfsdp_ckpt.tools import list_checkpoints
from mfsdp_core import (
    MixedPrecision,
    clip_grad_norm_,
    fully_shard,
    fully_shard_optimizer,
    set_comm_stream,
)
from mfsdp_core.collectives import rank0_decides
from mfsdp_core.data import SyntheticText, TokenFile
from mfsdp_core.expert_parallel import init_expert_mesh
from mfsdp_core.hsdp import hsdp_groups, hsdp_placement
from mfsdp_core.muon import Muon, uses_muon
from mfsdp_core.mx import MXFormat
from mfsdp_core.plan import DEFAULT_GROUP, mx_marked

from .common import _human
from .model_base import ModelSource
from .run_config import run_config
from .train_args import _AUTO, UsageError, check_flags
from .train_launch import launched_by_us
from .train_signals import EXIT_CODES, StopRequests, stop_signal
from .train_start import (
    check_model,
    checked_checkpoint,
    open_data,
    refuse_locked,
    resolve_auto_resume,
    resume_point,
)
from .train_tensorboard import TensorBoard, open_tensorboard


def check_args(args: argparse.Namespace, world: int) -> ModelSource:
    """Validate flags before anything is built: what the flags decide alone
    (:func:`cli.train_args.check_flags`), then what needs the model
    (:func:`cli.train_start.check_model`: the model, CUDA, the data file), both the launcher's
    pre-flight too, then what only a rank checks (an object-store ``--ckpt-dir``); returns the model source (``args.model``
    becomes its name)."""
    check_flags(args, world)
    source = check_model(args, world)
    if args.ckpt_dir and not mfsdp_fs.is_local(args.ckpt_dir):  # fail now, not at the first save
        try:
            check_writable_prefix(args.ckpt_dir)
        except mfsdp_ckpt.CheckpointError as e:
            raise UsageError(f"--ckpt-dir {e}") from None
    return source


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up to ``--lr``, then cosine decay to ``--min-lr`` at ``--steps``: a pure
    function of the step, so nothing about the schedule needs checkpointing."""
    if step <= args.warmup:
        return args.lr * step / max(args.warmup, 1)
    progress = min((step - args.warmup) / max(args.steps - args.warmup, 1), 1.0)
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * progress))


def build(source: ModelSource, args: argparse.Namespace) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The source's model, every unit ``fully_shard``-ed, and its sharded optimizer."""
    mesh = init_expert_mesh(args.ep, source.num_experts) if args.ep > 1 else None
    groups: dict[str, Any] | None = None if mesh is None else dict(mesh.groups)
    if args.dp_replicate > 1:
        groups = {**(groups or {DEFAULT_GROUP: dist.group.WORLD}), **hsdp_groups(args.dp_replicate)}
    model = source.build(args, mesh)  # whole on every rank (same seed), so that each expert starts as in one process
    if torch.cuda.is_available():
        model = model.cuda()
    place = source.placement(args.policy, mesh)
    if args.mxfp8:
        weights = source.linear_weights(model)
        if not weights:
            raise UsageError(f"--mxfp8: not supported for {source.kind} models (docs/models.md)")
        place = mx_marked(place, dict.fromkeys(map(id, weights), MXFormat(args.mxfp8, args.mx_rule)))
    if args.dp_replicate > 1:
        place = hsdp_placement(place, shard_optim_across_replicas=args.hfsdp)
    mp = MixedPrecision(param_dtype=torch.bfloat16 if args.param_dtype == "bfloat16" else None)
    for unit in source.shard_units(model):
        try:
            fully_shard(
                unit,
                mesh=groups,
                strategy=args.strategy,
                placement=place,
                mixed_precision=mp,
            )
        except ValueError as e:
            raise UsageError(str(e)) from None
    source.after_shard(model)
    if args.moe_aux_loss == "global":
        try:
            source.use_global_aux_loss(model)
        except ValueError as e:
            raise UsageError(str(e)) from None
    if args.comm_stream:
        try:
            set_comm_stream(model, True)
        except ValueError as e:
            raise UsageError(f"--comm-stream: {e}") from None
    if args.optimizer == "muon":
        return model, fully_shard_optimizer(build_muon(model, args))
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    kind = torch.optim.SGD if args.optimizer == "sgd" else torch.optim.AdamW
    return model, fully_shard_optimizer(kind(groups, lr=args.lr))


def build_muon(model: torch.nn.Module, args: argparse.Namespace) -> Muon:
    """Muon for the hidden matrices (``uses_muon``: every 2-D weight but the embedding and the
    output layer) at ``--muon-lr``, AdamW at ``--lr`` for the rest (no decay on 1-D weights).
    Every group follows the same schedule: its ``lr_ratio`` scales ``--lr``'s."""
    muon, decay, no_decay = [], [], []
    for name, p in model.named_parameters():
        (muon if uses_muon(name, p) else decay if p.ndim >= 2 else no_decay).append(p)
    return Muon(
        [
            {
                "params": muon,
                "use_muon": True,
                "lr": args.muon_lr,
                "lr_ratio": args.muon_lr / args.lr,
                "weight_decay": args.weight_decay,
            },
            {"params": decay, "use_muon": False, "lr": args.lr, "weight_decay": args.weight_decay},
            {"params": no_decay, "use_muon": False, "lr": args.lr, "weight_decay": 0.0},
        ],
        ns_dtype=args.ns_dtype,
    )


def memory_mib() -> float:
    """Peak resident memory of this process, MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def refuse_held_dir(args: argparse.Namespace) -> None:
    """Rank 0, before anything is built: refuse a ``--ckpt-dir`` that already holds a run unless it
    is resumed (starting again at step 0 would move ``latest`` back and replace equal step
    numbers), and one another job is writing into (its writer lock held). Creates nothing."""
    refuse_locked(args)
    if args.ckpt_dir and not args.resume and mfsdp_fs.isdir(mfsdp_fs.normalize(args.ckpt_dir)):
        _refuse_held(args)


def claim_run_dir(args: argparse.Namespace, run: contextlib.ExitStack) -> None:
    """Rank 0, once the run is accepted (its start checkpoint checked, the model built and loaded)
    and for the rest of it: hold the writer lock of ``--ckpt-dir``, creating it (a second job
    writing there is refused), and check again under the lock that it holds no other run. A
    refusal before this point leaves no directory behind. An object store has no lock: one job per
    prefix is the user's responsibility."""
    if not args.ckpt_dir or not mfsdp_fs.is_local(args.ckpt_dir):
        return
    try:
        run.enter_context(mfsdp_ckpt.run_lock(args.ckpt_dir))
    except mfsdp_ckpt.CheckpointError as e:
        raise UsageError(f"--ckpt-dir: {e}") from None
    if not args.resume:
        _refuse_held(args)


def _refuse_held(args: argparse.Namespace) -> None:
    held = [e.name for e in list_checkpoints(args.ckpt_dir) if e.committed]
    if held:
        raise UsageError(
            f"--ckpt-dir {args.ckpt_dir} already holds checkpoints ({shown_list(held[::-1], 3)}); "
            "pass --resume to continue that run, or choose another directory"
        )


def train(args: argparse.Namespace, source: ModelSource, rank: int, world: int, stops: StopRequests) -> int:
    """Run the training; the exit code (0, or the code of the signal it stopped for)."""
    if args.resume == _AUTO:
        args.resume = rank0_decides(resolve_auto_resume, args)
        if rank == 0 and args.resume is None:
            print(f"--resume auto: no checkpoint in {args.ckpt_dir}, starting fresh", flush=True)
    rank0_decides(refuse_held_dir, args)
    # rank 0 picks the checkpoint for all: ranks resolving ``latest`` each by itself could pick
    # different ones if it moves meanwhile (another job still writing into --ckpt-dir)
    if args.resume:
        args.resume = rank0_decides(resume_point, args, source)
    if args.init_from:
        args.init_from = rank0_decides(checked_checkpoint, args.init_from, source, "--init-from")
    return _train(args, source, rank, world, stops)


def _start(
    args: argparse.Namespace, source: ModelSource, model: torch.nn.Module, optim: Any, rank: int, world: int
) -> tuple[int, int]:
    """Load what ``--resume`` / ``--init-from`` name into the fresh model; ``(step, data position)``.

    Both load with ``atomic=False`` (read straight into place, one pass over the bytes): the model
    is freshly initialised, so a failed load loses nothing, and the run stops with its error."""
    step, position = 0, 0
    if args.resume:
        try:
            extra = mfsdp_ckpt.load(args.resume, model, optim, atomic=False)
        except mfsdp_ckpt.CheckpointError as e:
            raise UsageError(f"--resume: {e}") from None
        if not isinstance(extra.get("step"), int) or not isinstance(extra.get("data_position"), int):
            raise UsageError(
                f"--resume: {args.resume} holds no trainer state (extra.step, extra.data_position); "
                "it was not written by this trainer: start from its weights with --init-from instead"
            )
        step, position = extra["step"], extra["data_position"]
        source.resumed(extra)
        if rank == 0:
            print(f"resumed from {args.resume} at step {step} (world size {world})", flush=True)
    if args.init_from:
        try:  # model weights only; the optimizer, step and data position start fresh
            mfsdp_ckpt.load(args.init_from, model, None, restore_rng=False, atomic=False)
        except mfsdp_ckpt.CheckpointError as e:
            raise UsageError(f"--init-from: {e}") from None
        if rank == 0:
            print(f"initialised from the weights of {args.init_from} (world size {world})", flush=True)
    return step, position


def _train(args: argparse.Namespace, source: ModelSource, rank: int, world: int, stops: StopRequests) -> int:
    """Build, load and train (the start checkpoint already checked); the exit code."""
    if args.mxfp8:
        prepare_native_kernel(rank)
    model, optim = build(source, args)
    device = next(model.parameters()).device
    data = open_data(args, source)
    step, position = _start(args, source, model, optim, rank, world)
    with contextlib.ExitStack() as run:
        rank0_decides(claim_run_dir, args, run)
        return _loop(args, source, rank, world, stops, (model, optim, data, device), step, position)


def _loop(
    args: argparse.Namespace,
    source: ModelSource,
    rank: int,
    world: int,
    stops: StopRequests,
    built: tuple[torch.nn.Module, Any, SyntheticText | TokenFile, torch.device],
    step: int,
    position: int,
) -> int:
    """The accepted run, from ``step``: its header, the steps, the saves, its last line."""
    model, optim, data, device = built
    if rank == 0:
        for line in run_header(args, source, world):
            print(line, flush=True)
    last = min(args.steps, args.stop_at or args.steps)
    bar = _progress(rank, step, last)
    saving = _AsyncSaves(rank, bar) if args.async_save else None
    loop = _Loop(args, source, rank, world, model, optim, data, device, bar, saving, stops)
    loop.tb = open_tensorboard(args, rank, step)  # --tensorboard: rank 0's curves (None elsewhere)
    if saving is not None:
        saving.tb = loop.tb
    try:
        done, stopped_by = loop.run(step, position, last)
        if saving is not None:
            saving.finish()  # the last save is committed before the run ends (--stop-at included)
    finally:
        if saving is not None:
            saving.wait()  # on an error: let the save in flight end before the process group goes
        if loop.tb is not None:
            loop.tb.close()
    if bar is not None:
        bar.close()
    if rank == 0:
        print(stop_reason(args, step, done, stopped_by), flush=True)
    return 0 if stopped_by is None else EXIT_CODES[stopped_by]


def run_header(args: argparse.Namespace, source: ModelSource, world: int) -> list[str]:
    """What the run trains and how: every setting that changes the maths or the layout."""
    ep = f", EP {args.ep} x expert-data-parallel {world // args.ep}" if args.ep > 1 else ""
    if args.dp_replicate > 1:
        ep += f", {'HFSDP' if args.hfsdp else 'HSDP'} {args.dp_replicate} replicas x {world // args.dp_replicate}"
    kind = "" if source.kind == "mfsdp-gpt" else f" ({source.kind})"
    policy = f"policy {args.policy}"
    if args.mxfp8:
        policy += ", MXFP8 linear weights block(32)"
    dtype = {"float32": "fp32", "bfloat16": "bf16 (main params, optimizer state, reductions fp32)"}
    mx = f", MXFP8 {args.mxfp8} weights (scale rule {args.mx_rule})" if args.mxfp8 else ""
    if args.optimizer == "muon":
        optimizer = (
            f"muon (lr {args.muon_lr:g}, Newton-Schulz {args.ns_dtype}) for hidden matrices, adamw (lr {args.lr:g}) "
            "for the rest"
        )
    else:
        optimizer = f"{args.optimizer} (lr {args.lr:g})"
    aux = ", MoE aux loss over all ranks' tokens" if args.moe_aux_loss == "global" else ""
    return [
        f"model {args.model}{kind}, {source.n_params():,} parameters, "
        f"world size {world}{ep}, strategy {args.strategy}, {policy}",
        f"precision compute {dtype[args.param_dtype]}{mx}; optimizer {optimizer}, min lr {args.min_lr:g}, "
        f"warm-up {args.warmup}, weight decay {args.weight_decay:g}, clip {args.clip:g}{aux}",
        f"data {args.data or 'synthetic'}, batch {args.batch_size} x {args.seq_len} tokens"
        f"{f' in {args.micro_batches} micro-batches' if args.micro_batches > 1 else ''}, {args.steps} steps, "
        f"seed {args.seed}",
        _checkpoint_line(args),
    ]


def _checkpoint_line(args: argparse.Namespace) -> str:
    """Where the run saves: said once, so that a run without ``--ckpt-dir`` (a resume from a path,
    say) does not look as if it saved."""
    if not args.ckpt_dir:
        return "checkpoints: none (no --ckpt-dir: this run saves nothing)"
    every = f"every {args.save_every} steps and at the end" if args.save_every else "at the end"
    keep = f", keeping the newest {args.keep}" if args.keep else ""
    return f"checkpoints: {args.ckpt_dir}, {every}{keep}{' (async)' if args.async_save else ''}"


def prepare_native_kernel(rank: int) -> None:
    """Build (or load) the native MXFP8 cast kernel now rather than in the first step: a build (first
    use, or the sources or flags changed since the cached one) takes about a minute, and
    ``mx_native`` says so on stderr whenever one runs, from the process that runs it."""
    from mfsdp_core import mx_native

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if mx_native.load(device) is None and rank == 0:
        print(f"native MXFP8 kernel unavailable: {mx_native.unavailable_reason(device)}", flush=True)


def last_checkpoint(args: argparse.Namespace) -> str:
    """Where an interrupted run can go on from: its last committed checkpoint."""
    if not args.ckpt_dir:
        return "no --ckpt-dir, so there is no checkpoint to continue from"
    try:
        committed = [e for e in list_checkpoints(args.ckpt_dir) if e.committed]
    except (mfsdp_ckpt.CheckpointError, OSError):
        committed = []
    if not committed:
        return f"no committed checkpoint in {args.ckpt_dir} yet"
    return f"last checkpoint {committed[-1].name} (committed); continue with --resume"


def stop_reason(args: argparse.Namespace, first: int, done: int, stopped_by: signal.Signals | None = None) -> str:
    """The run's last line: why it stopped, and how to go on when it can."""
    if stopped_by == signal.SIGINT:
        return f"interrupted at step {done}; {last_checkpoint(args)}"
    if stopped_by == signal.SIGTERM:
        saved = f"saved step_{done:06d}; continue with --resume" if args.ckpt_dir else last_checkpoint(args)
        return f"stopped by SIGTERM after step {done}: {saved}"
    if done == first:
        limit = (
            f"--stop-at {args.stop_at}"
            if args.stop_at is not None and args.stop_at < args.steps
            else f"--steps {args.steps}"
        )
        return f"nothing to do: the run is already at step {first} ({limit})"
    if done >= args.steps:
        return f"finished: step {done} of {args.steps}"
    how = "continue with --resume" if args.ckpt_dir else "no --ckpt-dir, so there is no checkpoint to continue from"
    return f"stopped at step {done} of {args.steps}: reached --stop-at {args.stop_at}; {how}"


class _Loop:
    """The training loop over ``[step, last)``: each step, its log line, its save, and the stop
    the ranks agree on after a step when one of them was signalled."""

    tb: TensorBoard | None = None  # --tensorboard's writer (rank 0)

    def __init__(
        self,
        args: argparse.Namespace,
        source: ModelSource,
        rank: int,
        world: int,
        model: torch.nn.Module,
        optim: torch.optim.Optimizer,
        data: SyntheticText | TokenFile,
        device: torch.device,
        bar: Any,
        saving: _AsyncSaves | None,
        stops: StopRequests,
    ) -> None:
        self.args, self.source, self.rank, self.world = args, source, rank, world
        self.model, self.optim, self.data, self.device = model, optim, data, device
        self.bar, self.saving, self.stops = bar, saving, stops
        self.window = _StepTimes()

    def run(self, step: int, position: int, last: int) -> tuple[int, signal.Signals | None]:
        """Train to ``last``; the last step done, and the signal that stopped the run early if one did."""
        args = self.args
        while step < last:
            step += 1
            self.stops.step = step
            start = time.perf_counter()
            lr = lr_at(step, args)
            position, mean_loss, grad_norm, stop = self.step(step, position, lr)
            seconds = time.perf_counter() - start
            self.window.add(seconds)
            if self.rank == 0:
                _report(args, self.bar, step, last, mean_loss, lr, grad_norm, self.window)
            if self.tb is not None:
                self.tb.step(step, mean_loss, lr, grad_norm, seconds)
            if self.saving is not None:
                self.saving.poll()
            due = args.ckpt_dir and ((args.save_every and step % args.save_every == 0) or step == last)
            if due or (stop == signal.SIGTERM and args.ckpt_dir):
                self.save(step, position)
            if stop is not None:
                return step, stop
        return step, None

    def step(self, step: int, position: int, lr: float) -> tuple[int, float, float, signal.Signals | None]:
        """One optimizer step at ``lr``; ``(next data position, mean loss, grad norm, stop signal)``."""
        args, per_rank = self.args, self.args.batch_size // self.world
        for group in self.optim.param_groups:
            group["lr"] = lr * group["lr_ratio"] if "lr_ratio" in group else lr
        try:  # this rank's slice of the global batch (samples are a pure function of their index)
            tokens = self.data.batch(position + self.rank * per_rank, per_rank).to(self.device)
        except ValueError as e:  # a token id outside the vocabulary
            raise UsageError(str(e)) from None
        loss_sum = torch.zeros((), device=self.device)
        for micro in tokens.chunk(args.micro_batches):
            logits, aux_loss = self.source.forward(self.model, micro[:, :-1], micro[:, 1:])
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), micro[:, 1:].reshape(-1))
            ((loss + aux_loss) / args.micro_batches).backward()
            loss_sum += loss.detach() / args.micro_batches
        grad_norm = clip_grad_norm_(self.optim, args.clip)
        self.optim.step()
        self.source.after_step(self.model)
        self.optim.zero_grad()
        # the loss and the ranks' stop requests in one all-reduce: every rank stops after the same step
        totals = torch.cat([loss_sum.reshape(1), torch.tensor(self.stops.pending(), device=self.device)])
        if dist.is_initialized():
            dist.all_reduce(totals)
        summed = totals.tolist()
        return position + args.batch_size, summed[0] / self.world, grad_norm.item(), stop_signal(summed[1:])

    def save(self, step: int, position: int) -> None:
        """Checkpoint ``step`` into ``--ckpt-dir`` (in the background under ``--async-save``)."""
        args, source = self.args, self.source
        save = _timed_save if self.saving is None else self.saving.start
        started = time.perf_counter()
        try:
            line = save(
                mfsdp_fs.join(args.ckpt_dir, f"step_{step:06d}"),
                self.model,
                self.optim,
                extra={"step": step, "data_position": position, "model": args.model, **source.extra()},
                model_config=source.model_config(),
                model_source=source.record(),
                run_config=run_config(args),
                step=step,
                keep=args.keep,
                overwrite=True,
            )
        except mfsdp_ckpt.CheckpointError as e:
            raise UsageError(f"saving step {step}: {e}") from None
        if line is not None and self.rank == 0:
            _log(self.bar, line)
        if line is not None and self.tb is not None:
            self.tb.save(mfsdp_fs.join(args.ckpt_dir, f"step_{step:06d}"), time.perf_counter() - started)


def _timed_save(path: str, *args: Any, **kwargs: Any) -> str:
    """``mfsdp_ckpt.save``; returns its log line: name, bytes written, seconds, where."""
    start = time.perf_counter()
    saved = mfsdp_ckpt.save(path, *args, **kwargs)
    seconds = time.perf_counter() - start
    return f"saved {os.path.basename(saved)}: {_written(saved)} in {seconds:.2f} s to {saved}"


def _written(path: str) -> str:
    """The data-file bytes of a committed checkpoint, from its manifest, in the binary units every
    command prints (``?`` if it cannot be read)."""
    try:
        total = read_manifest(path).get("total_bytes")
    except mfsdp_ckpt.CheckpointError:
        total = None
    return f"{_human(total)} of data files" if isinstance(total, int) else "? bytes"


class _StepTimes:
    """Seconds of the steps since the last log line: the log reports their mean, not the last step's
    (one slow step, a save's or the first one's warm-up, would otherwise stand for the window)."""

    def __init__(self) -> None:
        self.seconds, self.steps = 0.0, 0

    def add(self, seconds: float) -> None:
        self.seconds += seconds
        self.steps += 1

    def take(self) -> float:
        """The mean step time of the window, which then starts again."""
        mean = self.seconds / max(self.steps, 1)
        self.seconds, self.steps = 0.0, 0
        return mean


class _AsyncSaves:
    """``--async-save``: at most one save in flight; rank 0 logs each save's blocking seconds
    (the call, and the optimizer step's wait for the background copy) and total seconds once it
    has committed. Errors surface where every rank is alike: at the next save
    and at the end of the run."""

    tb: TensorBoard | None = None  # --tensorboard's writer (rank 0)

    def __init__(self, rank: int, bar: Any) -> None:
        self.rank, self.bar = rank, bar
        self.handle: mfsdp_ckpt.AsyncSaveHandle | None = None
        self.logged = True

    def start(self, path: str, *args: Any, **kwargs: Any) -> None:
        """Start saving ``path`` in the background (logged once committed: returns no line now)."""
        self.finish()  # the previous save: committed (logged) or its error raised
        self.handle, self.logged = mfsdp_ckpt.async_save(path, *args, **kwargs), False

    def poll(self) -> None:
        """Log the save in flight if it has committed (never blocks, never raises)."""
        if self.handle is not None and self.handle.done() and self.handle.exception() is None:
            self._log()

    def finish(self) -> None:
        """Wait for the save in flight; raise its error as a usage error, else log it."""
        if self.handle is None:
            return
        try:
            self.handle.result()
        except mfsdp_ckpt.CheckpointError as e:
            name, self.handle = os.path.basename(self.handle.path), None
            raise UsageError(f"saving {name}: {e}") from None
        self._log()

    def wait(self) -> None:
        if self.handle is not None:
            self.handle.wait()

    def _log(self) -> None:
        if self.logged or self.rank != 0:
            self.logged = True
            return
        self.logged = True
        h = self.handle
        _log(
            self.bar,
            f"saved {os.path.basename(h.path)} (async): blocked {h.blocked_s:.3f} s "
            f"(call {h.call_s:.3f} s + fence {h.fence_s:.3f} s), total {h.total_s:.2f} s; "
            f"{_written(h.path)} to {h.path}",
        )
        if self.tb is not None:
            self.tb.save(h.path, h.total_s, h.blocked_s)


def _progress(rank: int, step: int, steps: int) -> Any:
    if rank != 0 or not sys.stdout.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=steps, initial=step, unit="step", dynamic_ncols=True, leave=False)


def _report(
    args: argparse.Namespace,
    bar: Any,
    step: int,
    last: int,
    loss: float,
    lr: float,
    grad_norm: float,
    window: _StepTimes,
) -> None:
    if args.metrics:
        with open(args.metrics, "a") as f:
            f.write(json.dumps({"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm}) + "\n")
    if step % args.log_every == 0 or step == last:
        mean = window.take()
        _log(
            bar,
            f"step {step:5d} | loss {loss:.4f} | lr {lr:.2e} | grad-norm {grad_norm:.3f} | "
            f"{mean * 1e3:,.1f} ms/step | {args.batch_size * args.seq_len / mean:,.0f} tok/s | "
            f"peak-rss {memory_mib():,.0f} MiB",
        )
    if bar is not None:
        bar.update(1)


def _log(bar: Any, line: str) -> None:
    """One line of the run's log, above the progress bar when there is one."""
    if bar is not None:
        bar.write(line)
    else:
        print(line, flush=True)


def run(args: argparse.Namespace) -> int:
    """One rank of the trainer (or the whole of a one-process run), on parsed flags; the exit code
    (1 a refused run, 130 interrupted, 143 stopped by SIGTERM after saving)."""
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    stops = StopRequests()
    stops.install()
    try:
        source = check_args(args, world)
        if "RANK" in os.environ:
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
            if torch.cuda.is_available():
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        return train(args, source, rank, world, stops)
    except UsageError as e:
        stops.uninstall()  # torchrun's SIGTERM must end a waiting rank (see _report_refusal)
        _report_refusal(str(e), rank)
        return 1
    except KeyboardInterrupt:  # a second Ctrl-C: stopped where it was (our launcher says it for the job)
        if rank == 0 and not launched_by_us():
            print(f"interrupted during step {stops.step + 1}; {last_checkpoint(args)}", file=sys.stderr, flush=True)
        return EXIT_CODES[signal.SIGINT]
    finally:
        stops.uninstall()
        if dist.is_initialized():
            _destroy_process_group()


#: how long a rank other than 0 waits before reporting a refusal itself (see _report_refusal)
REFUSAL_GRACE_S = 10.0


def _report_refusal(message: str, rank: int) -> None:
    """Print a refusal once per job: rank 0 prints it. Every rank of a job refuses the same flags,
    and the first rank to exit makes torchrun stop the others, so a rank other than 0 that exited
    at once could take rank 0 down before it printed (the job would end without a word). It waits
    instead, and torchrun stops it when rank 0 exits; still alive after the grace period, the
    refusal was its own (rank 0 went on), and it prints it."""
    if rank != 0:
        time.sleep(REFUSAL_GRACE_S)
        message = f"rank {rank}: {message}"
    print(f"error: {message}", file=sys.stderr, flush=True)


def _destroy_process_group() -> None:
    """Destroy the process group so that its backend goes now, while the interpreter is alive.

    gloo's worker threads stop only when the last reference to the group goes; the model's
    buffers hold references. Threads still running at interpreter exit can need the GIL there
    (to release a tensor a finished collective held) and get the job killed with SIGABRT after
    it did its work. ``train`` has returned, so nothing of ours refers to the model any more;
    a reference cycle can still hold it until some later collection (torch keeps the frames that
    first import ``torch._dynamo``, which building the first optimizer does, in one: with their
    locals), so collect first.
    """
    gc.collect()
    dist.destroy_process_group()
