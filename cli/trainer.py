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
from mfsdp_ckpt.errors import JobLostError, shown_list
from mfsdp_ckpt.format.run_identity import identity_of, new_identity
from mfsdp_ckpt.read.manifest import read_manifest
from mfsdp_ckpt.sharded.load import PARTLY_LOADED
from mfsdp_ckpt.storage import fs as mfsdp_fs
from mfsdp_ckpt.tier import MemoryTier
from mfsdp_ckpt.tools import list_checkpoints
from mfsdp_ckpt.write.destination import destination_for
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
from .settings import CheckpointSettings, Settings, StartPoint, TrainingSettings
from .train_args import _AUTO, _LATEST, UsageError, check_flags
from .train_restarts import note_first_step
from .train_signals import (
    EXIT_CODES,
    PEER_LOST_EXIT,
    StopRequests,
    interruptible,
    launched_by_us,
    peer_lost,
    stop_signal,
)
from .train_start import (
    check_model,
    decide_start,
    open_data,
    refuse_locked,
    resolve_auto_resume,
)
from .train_tensorboard import TensorBoard, open_tensorboard
from .train_tier import TierSnapshots, memory_tier, recover_run, restarted


def check_args(args: argparse.Namespace, world: int) -> tuple[Settings, ModelSource]:
    """Validate the flags into the run's settings before anything is built: what the flags decide
    alone (:func:`cli.train_args.check_flags`, which makes the frozen settings), then what needs
    the model (:func:`cli.train_start.check_model`: the model, CUDA, the data file), both the
    launcher's pre-flight too, then what only a rank checks (an object-store ``--ckpt-dir``);
    returns the settings and the model source (whose ``name`` is the run's model name)."""
    settings = check_flags(args, world)
    source = check_model(settings, world, settings.checkpoint.resume)
    ckpt_dir = settings.checkpoint.ckpt_dir
    if ckpt_dir:  # an object store's is probed now, not at the first save
        try:
            destination_for(ckpt_dir, kind="run").probe()
        except mfsdp_ckpt.CheckpointError as e:
            raise UsageError(f"--ckpt-dir {e}") from None
    return settings, source


def lr_at(step: int, training: TrainingSettings) -> float:
    """Linear warm-up to ``--lr``, then cosine decay to ``--min-lr`` at ``--steps``: a pure
    function of the step, so nothing about the schedule needs checkpointing."""
    t = training
    if step <= t.warmup:
        return t.lr * step / max(t.warmup, 1)
    progress = min((step - t.warmup) / max(t.steps - t.warmup, 1), 1.0)
    return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1 + math.cos(math.pi * progress))


def build(source: ModelSource, settings: Settings) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The source's model, every unit ``fully_shard``-ed, and its sharded optimizer."""
    parallel, precision = settings.parallelism, settings.precision
    mesh = init_expert_mesh(parallel.ep, source.num_experts) if parallel.ep > 1 else None
    groups: dict[str, Any] | None = None if mesh is None else dict(mesh.groups)
    if parallel.dp_replicate > 1:
        groups = {**(groups or {DEFAULT_GROUP: dist.group.WORLD}), **hsdp_groups(parallel.dp_replicate)}
    # whole on every rank (same seed), so that each expert starts as in one process
    model = source.build(settings.training.seed, mesh, settings.training.micro_batches)
    if torch.cuda.is_available():
        model = model.cuda()
    place = source.placement(parallel.policy, mesh)
    if precision.mxfp8:
        weights = source.linear_weights(model)
        if not weights:
            raise UsageError(f"--mxfp8: not supported for {source.kind} models (docs/models.md)")
        place = mx_marked(place, dict.fromkeys(map(id, weights), MXFormat(precision.mxfp8, precision.mx_rule)))
    if parallel.dp_replicate > 1:
        place = hsdp_placement(place, shard_optim_across_replicas=parallel.hfsdp)
    mp = MixedPrecision(param_dtype=torch.bfloat16 if precision.param_dtype == "bfloat16" else None)
    for unit in source.shard_units(model):
        try:
            fully_shard(
                unit,
                mesh=groups,
                strategy=parallel.strategy,
                placement=place,
                mixed_precision=mp,
            )
        except ValueError as e:
            raise UsageError(str(e)) from None
    source.after_shard(model)
    _runtime_options(source, model, settings)
    return model, fully_shard_optimizer(new_optimizer(model, settings))


def _runtime_options(source: ModelSource, model: torch.nn.Module, settings: Settings) -> None:
    """``--moe-aux-loss global`` and ``--comm-stream`` on the sharded model."""
    if settings.parallelism.moe_aux_loss == "global":
        try:
            source.use_global_aux_loss(model)
        except ValueError as e:
            raise UsageError(str(e)) from None
    if settings.parallelism.comm_stream:
        try:
            set_comm_stream(model, True)
        except ValueError as e:
            raise UsageError(f"--comm-stream: {e}") from None


def new_optimizer(model: torch.nn.Module, settings: Settings) -> torch.optim.Optimizer:
    """``--optimizer``'s optimizer of ``model`` (not yet sharded): Muon (:func:`build_muon`), or
    AdamW / SGD with decay on the 2-D weights only."""
    if settings.optimizer.optimizer == "muon":
        return build_muon(model, settings)
    training = settings.training
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": training.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    kind = torch.optim.SGD if settings.optimizer.optimizer == "sgd" else torch.optim.AdamW
    return kind(groups, lr=training.lr)


def build_muon(model: torch.nn.Module, settings: Settings) -> Muon:
    """Muon for the hidden matrices (``uses_muon``: every 2-D weight but the embedding and the
    output layer) at ``--muon-lr``, AdamW at ``--lr`` for the rest (no decay on 1-D weights).
    Every group follows the same schedule: its ``lr_ratio`` scales ``--lr``'s."""
    lr, decay_by, muon_lr = settings.training.lr, settings.training.weight_decay, settings.optimizer.muon_lr
    muon, decay, no_decay = [], [], []
    for name, p in model.named_parameters():
        (muon if uses_muon(name, p) else decay if p.ndim >= 2 else no_decay).append(p)
    return Muon(
        [
            {
                "params": muon,
                "use_muon": True,
                "lr": muon_lr,
                "lr_ratio": muon_lr / lr,
                "weight_decay": decay_by,
            },
            {"params": decay, "use_muon": False, "lr": lr, "weight_decay": decay_by},
            {"params": no_decay, "use_muon": False, "lr": lr, "weight_decay": 0.0},
        ],
        ns_dtype=settings.optimizer.ns_dtype,
    )


def memory_mib() -> float:
    """Peak resident memory of this process, MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def refuse_held_dir(ckpt_dir: str | None, resumes: bool) -> None:
    """Rank 0, before anything is built: refuse a ``--ckpt-dir`` that already holds a run unless it
    is resumed (``resumes``; starting again at step 0 would move ``latest`` back and replace equal
    step numbers), and one another job is writing into (its writer lock held). Creates nothing."""
    refuse_locked(ckpt_dir)
    if ckpt_dir and not resumes and mfsdp_fs.isdir(mfsdp_fs.normalize(ckpt_dir)):
        _refuse_held(ckpt_dir)


def claim_run_dir(ckpt_dir: str | None, resumes: bool, run: contextlib.ExitStack) -> None:
    """Rank 0, once the run is accepted (its start checkpoint checked, the model built and loaded)
    and for the rest of it: hold the writer lock of ``--ckpt-dir``, creating it (a second job
    writing there is refused), and check again under the lock that it holds no other run. A
    refusal before this point leaves no directory behind. An object store has no lock: one job per
    prefix is the user's responsibility."""
    if not ckpt_dir:
        return
    try:
        run.enter_context(destination_for(ckpt_dir, kind="run").hold())  # an object store: no lock
    except mfsdp_ckpt.CheckpointError as e:
        raise UsageError(f"--ckpt-dir: {e}") from None
    if not resumes and mfsdp_fs.isdir(mfsdp_fs.normalize(ckpt_dir)):  # an object store's prefix may not exist yet
        _refuse_held(ckpt_dir)


def _refuse_held(ckpt_dir: str) -> None:
    held = [e.name for e in list_checkpoints(ckpt_dir) if e.committed]
    if held:
        raise UsageError(
            f"--ckpt-dir {ckpt_dir} already holds checkpoints ({shown_list(held[::-1], 3)}); "
            "pass --resume to continue that run, or choose another directory"
        )


def train(settings: Settings, source: ModelSource, rank: int, world: int, stops: StopRequests) -> int:
    """Run the training; the exit code (0, or the code of the signal it stopped for)."""
    start = start_point(settings, source, rank)
    return _train(settings, source, start, rank, world, stops)


def start_point(settings: Settings, source: ModelSource, rank: int) -> StartPoint:
    """What the run starts from, decided once, by rank 0 for all (ranks resolving ``latest`` each
    by itself could pick different ones if it moves meanwhile: another job still writing into
    ``--ckpt-dir``): ``--resume auto`` resolved, a ``--ckpt-dir`` holding another run refused,
    then the checkpoint checked (:func:`cli.train_start.decide_start`)."""
    ckpt = settings.checkpoint
    resume = ckpt.resume
    if resume is None and ckpt.mem_tier and restarted():
        resume = _AUTO  # restarted after a failure: continue the run (from memory, or --ckpt-dir)
    if resume == _AUTO:
        resume = rank0_decides(resolve_auto_resume, ckpt)
        if rank == 0 and resume is None and not ckpt.mem_tier:  # (with a tier, said once the ranks looked in it)
            print(f"--resume auto: no checkpoint in {ckpt.ckpt_dir}, starting fresh", flush=True)
    rank0_decides(refuse_held_dir, ckpt.ckpt_dir, bool(resume))
    return rank0_decides(decide_start, settings, resume, source)


def _start(
    start: StartPoint,
    settings: Settings,
    source: ModelSource,
    built: tuple[torch.nn.Module, Any],
    rank: int,
    world: int,
    tier: MemoryTier | None = None,
) -> tuple[int, int, bool, str, str, tuple[torch.nn.Module, Any]]:
    """Load what the run starts from into the fresh model: the memory tier's newest whole
    snapshot of this run when ``tier`` is given and it is at least as new as the durable
    checkpoint (:func:`cli.train_tier.recover_run`: its run identity, model and settings checked;
    one whose load fails passed over for the next whole state, the model rebuilt), else
    ``--resume`` / ``--init-from``'s checked checkpoint; ``(step, data position, resumed, where
    it started from in words, the run's identity, the model and optimizer to train)``.

    Every load is ``atomic=False`` (read straight into place, one pass over the bytes): the model
    is freshly initialised, so a failed load loses nothing, and the run stops with its error
    (a snapshot's: it falls back)."""
    step, position = 0, 0
    model, optim = built
    if tier is not None:
        durable = start.path if start.resumes else None
        recovery, (model, optim) = recover_run(
            tier, settings, source, durable, (model, optim), lambda: build(source, settings)
        )
        if recovery.step is not None:
            source.resumed(recovery.extra)
            if rank == 0:
                passed = f"; passed over {recovery.why}" if recovery.why else ""
                print(
                    f"recovered from the memory tier at step {recovery.step} in {recovery.seconds:.2f} s "
                    f"(world size {world}){passed}",
                    flush=True,
                )
            where = f"the memory tier at step {recovery.step}"
            identity = _identity_of(recovery.path)
            return recovery.extra["step"], recovery.extra["data_position"], True, where, identity, (model, optim)
        if start.resumes and start.path is None and settings.checkpoint.resume == _LATEST:
            raise UsageError(
                f"--resume: no checkpoint to resume from: the memory tier holds no whole snapshot ({recovery.why}) "
                f"and {settings.checkpoint.ckpt_dir} no committed checkpoint"
            )
        if rank == 0 and start.path:
            print(f"memory tier: nothing recovered ({recovery.why}); resuming from {start.path}", flush=True)
        elif rank == 0:
            print(
                f"no checkpoint in {settings.checkpoint.ckpt_dir} and nothing recovered from the memory tier "
                f"({recovery.why}); starting fresh",
                flush=True,
            )
    if start.resumes and start.path:
        try:
            extra = mfsdp_ckpt.load(start.path, model, optim, atomic=False)
        except mfsdp_ckpt.CheckpointError as e:
            raise _refusal("--resume", e) from None
        if not isinstance(extra.get("step"), int) or not isinstance(extra.get("data_position"), int):
            raise UsageError(
                f"--resume: {start.path} holds no trainer state (extra.step, extra.data_position); "
                "it was not written by this trainer: start from its weights with --init-from instead"
            )
        step, position = extra["step"], extra["data_position"]
        source.resumed(extra)
        if rank == 0:
            print(f"resumed from {start.path} at step {step} (world size {world})", flush=True)
        where = f"{start.path} at step {step}"
        return step, position, True, where, _identity_of(start.path), (model, optim)
    if start.flag == "--init-from":
        fresh = source.starts_fresh(read_manifest(start.path))
        try:  # model weights only; the optimizer, step and data position start fresh
            mfsdp_ckpt.load(start.path, model, None, restore_rng=False, atomic=False, fresh=fresh)
        except mfsdp_ckpt.CheckpointError as e:
            raise _refusal("--init-from", e) from None
        if rank == 0:
            also = f"; {len(fresh)} adapter tensors it does not hold start fresh" if fresh else ""
            print(f"initialised from the weights of {start.path} (world size {world}){also}", flush=True)
    where = f"the weights of {start.path}" if start.flag == "--init-from" else "a fresh start"
    return step, position, False, where, rank0_decides(new_identity), (model, optim)


def _identity_of(path: str | None) -> str:
    """The run identity the checkpoint at ``path`` records, carried over by the run that
    continues it (rank 0 reads it for all); a new one when it records none (written before
    identities were recorded)."""

    def read() -> str:
        try:
            found = identity_of(read_manifest(path)) if path else None
        except mfsdp_ckpt.CheckpointError:
            found = None
        return found or new_identity()

    return rank0_decides(read)


def _refusal(what: str, error: mfsdp_ckpt.CheckpointError) -> Exception:
    """What a checkpoint error stops the run with: one line, ``what: error`` (a load's note that
    the model is partly loaded left out: the run built that model and stops before training it);
    a lost peer (:class:`~mfsdp_ckpt.errors.JobLostError`) stays what it is, since another rank's
    failure is not this rank's to report (:func:`run` ends such a rank quietly)."""
    if isinstance(error, JobLostError):
        return error
    message = str(error).removesuffix(f"; {PARTLY_LOADED}")
    if message != str(error):
        message += "; the run stopped before training (nothing was written)"
    return UsageError(f"{what}: {message}")


def _train(
    settings: Settings, source: ModelSource, start: StartPoint, rank: int, world: int, stops: StopRequests
) -> int:
    """Build, load and train (the start checkpoint already checked); the exit code."""
    if settings.precision.mxfp8:
        prepare_native_kernel(rank)
    model, optim = build(source, settings)
    device = next(model.parameters()).device
    data = open_data(settings, source)
    tier = memory_tier(settings.checkpoint, world)
    recovering = tier is not None and (settings.checkpoint.resume in (_AUTO, _LATEST) or restarted())
    if tier is not None and not recovering:
        TierSnapshots(tier, settings.checkpoint.mem_every, rank).remove()  # a fresh run: nothing of an earlier one
    step, position, resumed, where, identity, (model, optim) = _start(
        start, settings, source, (model, optim), rank, world, tier if recovering else None
    )
    with contextlib.ExitStack() as run:
        rank0_decides(claim_run_dir, settings.checkpoint.ckpt_dir, resumed, run)
        built = (model, optim, data, device)
        return _loop(settings, source, rank, world, stops, built, step, position, (where, identity))


def _loop(
    settings: Settings,
    source: ModelSource,
    rank: int,
    world: int,
    stops: StopRequests,
    built: tuple[torch.nn.Module, Any, SyntheticText | TokenFile, torch.device],
    step: int,
    position: int,
    started: tuple[str, str],
) -> int:
    """The accepted run, from ``step`` (``started``: where it started from in words, and the
    run's identity, which every checkpoint it writes records): its header, the steps, the saves,
    its last line."""
    model, optim, data, device = built
    started_from, identity = started
    if rank == 0:
        for line in run_header(settings, source, world):
            print(line, flush=True)
    training = settings.training
    last = min(training.steps, training.stop_at or training.steps)
    bar = _progress(rank, step, last)
    saving = _AsyncSaves(rank, bar) if settings.checkpoint.async_save else None
    loop = _Loop(settings, source, rank, world, model, optim, data, device, bar, saving, stops)
    loop.started_from, loop.identity = started_from, identity
    tier = memory_tier(settings.checkpoint, world)
    if tier is not None:
        loop.snapshots = TierSnapshots(tier, settings.checkpoint.mem_every, rank, log=lambda line: _log(bar, line))
    loop.tb = open_tensorboard(settings, rank, step)  # --tensorboard: rank 0's curves (None elsewhere)
    if saving is not None:
        saving.tb = loop.tb
    try:
        done, stopped_by = loop.run(step, position, last)
        if saving is not None:
            saving.finish()  # the last save is committed before the run ends (--stop-at included)
        if loop.snapshots is not None:
            loop.snapshots.finish()  # and the last snapshot
    finally:
        if saving is not None:
            saving.wait()  # on an error: let the save in flight end before the process group goes
        if loop.snapshots is not None and loop.snapshots.handle is not None:
            loop.snapshots.handle.wait()
        if loop.tb is not None:
            loop.tb.close()
    if bar is not None:
        bar.close()
    if loop.snapshots is not None and stopped_by is None and not settings.checkpoint.mem_keep_on_exit:
        loop.snapshots.remove()  # the run ended normally: its durable checkpoints are what it leaves
    if rank == 0:
        print(stop_reason(settings, step, done, stopped_by), flush=True)
    return 0 if stopped_by is None else EXIT_CODES[stopped_by]


def run_header(settings: Settings, source: ModelSource, world: int) -> list[str]:
    """What the run trains and how: every setting that changes the maths or the layout."""
    par, pre, t = settings.parallelism, settings.precision, settings.training
    ep = f", EP {par.ep} x expert-data-parallel {world // par.ep}" if par.ep > 1 else ""
    if par.dp_replicate > 1:
        ep += f", {'HFSDP' if par.hfsdp else 'HSDP'} {par.dp_replicate} replicas x {world // par.dp_replicate}"
    kind = "" if source.kind == "mfsdp-gpt" else f" ({source.kind})"
    policy = f"policy {par.policy}"
    if pre.mxfp8:
        policy += ", MXFP8 linear weights block(32)"
    dtype = {"float32": "fp32", "bfloat16": "bf16 (main params, optimizer state, reductions fp32)"}
    mx = f", MXFP8 {pre.mxfp8} weights (scale rule {pre.mx_rule})" if pre.mxfp8 else ""
    aux = ", MoE aux loss over all ranks' tokens" if par.moe_aux_loss == "global" else ""
    return [
        f"model {source.name}{kind}, {source.n_params():,} parameters{source.trainable_note()}, "
        f"world size {world}{ep}, strategy {par.strategy}, {policy}",
        f"precision compute {dtype[pre.param_dtype]}{mx}; optimizer {_optimizer_words(settings)}, "
        f"min lr {t.min_lr:g}, warm-up {t.warmup}, weight decay {t.weight_decay:g}, clip {t.clip:g}{aux}",
        f"data {settings.data.data or 'synthetic'}, batch {t.batch_size} x {t.seq_len} tokens"
        f"{f' in {t.micro_batches} micro-batches' if t.micro_batches > 1 else ''}, {t.steps} steps, "
        f"seed {t.seed}",
        _checkpoint_line(settings.checkpoint, world),
        *([f"tensorboard: {settings.logging.tensorboard}"] if settings.logging.tensorboard else []),
    ]


def _optimizer_words(settings: Settings) -> str:
    """The header's optimizer: its name and learning rate(s)."""
    opt, lr = settings.optimizer, settings.training.lr
    if opt.optimizer == "muon":
        return f"muon (lr {opt.muon_lr:g}, Newton-Schulz {opt.ns_dtype}) for hidden matrices, adamw (lr {lr:g}) for the rest"
    return f"{opt.optimizer} (lr {lr:g})"


def _checkpoint_line(ckpt: CheckpointSettings, world: int) -> str:
    """Where the run saves: said once, so that a run without ``--ckpt-dir`` (a resume from a path,
    say) does not look as if it saved; the memory tier with the copies it really keeps."""
    if not ckpt.ckpt_dir:
        return "checkpoints: none (no --ckpt-dir: this run saves nothing)"
    every = f"every {ckpt.save_every} steps and at the end" if ckpt.save_every else "at the end"
    keep = f", keeping the newest {ckpt.keep}" if ckpt.keep else ""
    line = f"checkpoints: {ckpt.ckpt_dir}, {every}{keep}{' (async)' if ckpt.async_save else ''}"
    tier = memory_tier(ckpt, world)
    if tier is not None:
        nodes = tier.nodes(world)
        copies = len(tier.replica_holders(0, nodes))
        replicas = f"{copies} replica(s) on peer nodes" if copies else "no replica (one node)"
        line += (
            f"; memory tier {ckpt.mem_tier}, every {ckpt.mem_every} steps, keeping {ckpt.mem_keep}, "
            f"{replicas}, {nodes} node(s) of {tier.node_size} ranks"
        )
    return line


def prepare_native_kernel(rank: int) -> None:
    """Build (or load) the native MXFP8 cast kernel now rather than in the first step: a build (first
    use, or the sources or flags changed since the cached one) takes about a minute, and
    ``mx_native`` says so on stderr whenever one runs, from the process that runs it."""
    from mfsdp_core import mx_native

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if mx_native.load(device) is None and rank == 0:
        print(f"native MXFP8 kernel unavailable: {mx_native.unavailable_reason(device)}", flush=True)


def last_checkpoint(ckpt_dir: str | None) -> str:
    """Where an interrupted run can go on from: its last committed checkpoint in ``ckpt_dir``."""
    if not ckpt_dir:
        return "no --ckpt-dir, so there is no checkpoint to continue from"
    try:
        committed = [e for e in list_checkpoints(ckpt_dir) if e.committed]
    except (mfsdp_ckpt.CheckpointError, OSError):
        committed = []
    if not committed:
        return f"no committed checkpoint in {ckpt_dir} yet"
    return f"last checkpoint {committed[-1].name} (committed); continue with --resume"


def stop_reason(settings: Settings, first: int, done: int, stopped_by: signal.Signals | None = None) -> str:
    """The run's last line: why it stopped, and how to go on when it can."""
    ckpt_dir, steps, stop_at = settings.checkpoint.ckpt_dir, settings.training.steps, settings.training.stop_at
    if stopped_by == signal.SIGINT:
        return f"interrupted at step {done}; {last_checkpoint(ckpt_dir)}"
    if stopped_by == signal.SIGTERM:
        saved = f"saved step_{done:06d}; continue with --resume" if ckpt_dir else last_checkpoint(ckpt_dir)
        return f"stopped by SIGTERM after step {done}: {saved}"
    if done == first:
        limit = f"--stop-at {stop_at}" if stop_at is not None and stop_at < steps else f"--steps {steps}"
        return f"nothing to do: the run is already at step {first} ({limit})"
    if done >= steps:
        return f"finished: step {done} of {steps}"
    how = "continue with --resume" if ckpt_dir else "no --ckpt-dir, so there is no checkpoint to continue from"
    return f"stopped at step {done} of {steps}: reached --stop-at {stop_at}; {how}"


class _Loop:
    """The training loop over ``[step, last)``: each step, its log line, its save, and the stop
    the ranks agree on after a step when one of them was signalled."""

    tb: TensorBoard | None = None  # --tensorboard's writer (rank 0)
    snapshots: TierSnapshots | None = None  # --mem-tier's
    started_from = "a fresh start"  # what the launcher is told after a restart's first step
    identity: str | None = None  # the run's identity, recorded in every checkpoint (run_config)

    def __init__(
        self,
        settings: Settings,
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
        self.settings, self.source, self.rank, self.world = settings, source, rank, world
        self.model, self.optim, self.data, self.device = model, optim, data, device
        self.bar, self.saving, self.stops = bar, saving, stops
        self.window = _StepTimes()
        self.first_step = True

    def run(self, step: int, position: int, last: int) -> tuple[int, signal.Signals | None]:
        """Train to ``last``; the last step done, and the signal that stopped the run early if one did."""
        settings, ckpt = self.settings, self.settings.checkpoint
        while step < last:
            step += 1
            self.stops.step = step
            start = time.perf_counter()
            lr = lr_at(step, settings.training)
            position, mean_loss, grad_norm, stop = self.step(step, position, lr)
            seconds = time.perf_counter() - start
            self.window.add(seconds)
            if self.rank == 0:
                _report(settings, self.bar, step, last, mean_loss, lr, grad_norm, self.window)
            if self.tb is not None:
                self.tb.step(step, mean_loss, lr, grad_norm, seconds)
            if self.first_step and restarted():  # --max-restarts: the launcher's line on this restart
                note_first_step(self.started_from)
            self.first_step = False
            if self.saving is not None:
                self.saving.poll()
            due = ckpt.ckpt_dir and ((ckpt.save_every and step % ckpt.save_every == 0) or step == last)
            saved = False
            if self.snapshots is not None and self.snapshots.due(step):
                # a durable save due now is the snapshot promoted, in the background (a SIGTERM
                # stop saves before it exits, in the foreground)
                promote = due and stop != signal.SIGTERM
                path = mfsdp_fs.normalize(mfsdp_fs.join(ckpt.ckpt_dir, f"step_{step:06d}")) if promote else None
                taken = self.snapshots.take(
                    step, self.model, self.optim, promote_to=path, keep=ckpt.keep, **self._contents(step, position)
                )
                saved = taken and promote
            if (due and not saved) or (stop == signal.SIGTERM and ckpt.ckpt_dir):
                self.save(step, position)
            if stop is not None:
                return step, stop
        return step, None

    def step(self, step: int, position: int, lr: float) -> tuple[int, float, float, signal.Signals | None]:
        """One optimizer step at ``lr``; ``(next data position, mean loss, grad norm, stop signal)``."""
        training = self.settings.training
        per_rank = training.batch_size // self.world
        for group in self.optim.param_groups:
            group["lr"] = lr * group["lr_ratio"] if "lr_ratio" in group else lr
        try:  # this rank's slice of the global batch (samples are a pure function of their index)
            tokens = self.data.batch(position + self.rank * per_rank, per_rank).to(self.device)
        except ValueError as e:  # a token id outside the vocabulary
            raise UsageError(str(e)) from None
        loss_sum = torch.zeros((), device=self.device)
        for micro in tokens.chunk(training.micro_batches):
            logits, aux_loss = self.source.forward(self.model, micro[:, :-1], micro[:, 1:])
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), micro[:, 1:].reshape(-1))
            ((loss + aux_loss) / training.micro_batches).backward()
            loss_sum += loss.detach() / training.micro_batches
        grad_norm = clip_grad_norm_(self.optim, training.clip)
        self.optim.step()
        self.source.after_step(self.model)
        self.optim.zero_grad()
        # the loss and the ranks' stop requests in one all-reduce: every rank stops after the same step
        totals = torch.cat([loss_sum.reshape(1), torch.tensor(self.stops.pending(), device=self.device)])
        if dist.is_initialized():
            dist.all_reduce(totals)
        summed = totals.tolist()
        return position + training.batch_size, summed[0] / self.world, grad_norm.item(), stop_signal(summed[1:])

    def _contents(self, step: int, position: int) -> dict[str, Any]:
        """What every checkpoint of ``step`` records besides the state (a save's and a snapshot's)."""
        source = self.source
        return {
            "extra": {"step": step, "data_position": position, "model": source.name, **source.extra()},
            "model_config": source.model_config(),
            "model_source": source.record(),
            "run_config": run_config(self.settings, source.name, self.identity),
        }

    def save(self, step: int, position: int) -> None:
        """Checkpoint ``step`` into ``--ckpt-dir`` (in the background under ``--async-save``)."""
        ckpt = self.settings.checkpoint
        save = _timed_save if self.saving is None else self.saving.start
        started = time.perf_counter()
        try:
            line = save(
                mfsdp_fs.join(ckpt.ckpt_dir, f"step_{step:06d}"),
                self.model,
                self.optim,
                **self._contents(step, position),
                step=step,
                keep=ckpt.keep,
                overwrite=True,
            )
        except mfsdp_ckpt.CheckpointError as e:
            raise _refusal(f"saving step {step}", e) from None
        if line is not None and self.rank == 0:
            _log(self.bar, line)
        if line is not None and self.tb is not None:
            self.tb.save(mfsdp_fs.join(ckpt.ckpt_dir, f"step_{step:06d}"), time.perf_counter() - started)


def _timed_save(path: str, *args: Any, **kwargs: Any) -> str:
    """``mfsdp_ckpt.save``; returns its log line: name, bytes written, seconds, where."""
    start = time.perf_counter()
    saved = mfsdp_ckpt.save(path, *args, **kwargs)
    seconds = time.perf_counter() - start
    return f"saved {os.path.basename(saved)}: {_written(saved)} in {seconds:.2f} s to {saved}"


def _written(path: str) -> str:
    """The data-file bytes of a committed checkpoint, from its manifest, in the binary units every
    command prints (``?`` if it cannot be read), and the base holding its frozen weights if any."""
    try:
        manifest = read_manifest(path)
    except mfsdp_ckpt.CheckpointError:
        manifest = {}
    total, base = manifest.get("total_bytes"), (manifest.get("base") or {}).get("name")
    written = f"{_human(total)} of data files" if isinstance(total, int) else "? bytes"
    return f"{written} (frozen weights: in {base})" if base else written


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
            raise _refusal(f"saving {name}", e) from None
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
    settings: Settings,
    bar: Any,
    step: int,
    last: int,
    loss: float,
    lr: float,
    grad_norm: float,
    window: _StepTimes,
) -> None:
    logging, training = settings.logging, settings.training
    if logging.metrics:
        with open(logging.metrics, "a") as f:
            f.write(json.dumps({"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm}) + "\n")
    if step % logging.log_every == 0 or step == last:
        mean = window.take()
        _log(
            bar,
            f"step {step:5d} | loss {loss:.4f} | lr {lr:.2e} | grad-norm {grad_norm:.3f} | "
            f"{mean * 1e3:,.1f} ms/step | {training.batch_size * training.seq_len / mean:,.0f} tok/s | "
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
    (1 a refused run, 130 interrupted, 143 stopped by SIGTERM after saving; under our launcher,
    3 and no traceback when a collective failed because another rank died). A rank of a torchrun
    job (``RANK`` set) joins the job's process group after its flags pass, and leaves it at the end."""
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        return run_rank(args, rank, world, join="RANK" in os.environ)
    finally:  # the job's group, or the one-rank group a lone process may start (MCore's parallel state)
        if dist.is_initialized():
            _destroy_process_group()


def run_rank(
    args: argparse.Namespace, rank: int, world: int, join: bool = False, refusal_grace: float | None = None
) -> int:
    """:func:`run` on a given rank: with ``join``, this rank joins the process group (after its flags
    pass); without, the caller owns a group already joined (a test harness's warm ranks run the
    trainer so). Whoever owns the process destroys the group at its end (:func:`run` does).
    ``refusal_grace`` replaces :data:`REFUSAL_GRACE_S` (see :func:`_report_refusal`) where no
    launcher stops the ranks after rank 0."""
    stops = StopRequests()
    stops.install()
    try:
        settings, source = check_args(args, world)
        if join:
            init_process_group("nccl" if torch.cuda.is_available() else "gloo")
            if torch.cuda.is_available():
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        return train(settings, source, rank, world, stops)
    except UsageError as e:
        stops.uninstall()  # torchrun's SIGTERM must end a waiting rank (see _report_refusal)
        _report_refusal(str(e), rank, REFUSAL_GRACE_S if refusal_grace is None else refusal_grace)
        return 1
    except RuntimeError as e:  # a peer died under a collective: our launcher names it, in one line
        if not (launched_by_us() and peer_lost(e)):
            raise
        return PEER_LOST_EXIT
    except JobLostError as e:  # the same, met by the checkpoint layer (a snapshot or save in flight)
        if not launched_by_us():  # a plain torchrun job: one line from each rank that met it
            print(f"error: rank {rank}: {e}", file=sys.stderr, flush=True)
        return PEER_LOST_EXIT
    except KeyboardInterrupt:  # a second Ctrl-C: stopped where it was (our launcher says it for the job)
        if rank == 0 and not launched_by_us():
            print(
                f"interrupted during step {stops.step + 1}; {last_checkpoint(args.ckpt_dir)}",
                file=sys.stderr,
                flush=True,
            )
        return EXIT_CODES[signal.SIGINT]
    finally:
        stops.uninstall()


#: how long a rank other than 0 waits before reporting a refusal itself (see _report_refusal)
REFUSAL_GRACE_S = 10.0


def init_process_group(backend: str) -> None:
    """The job's process group. Under torchrun's agent store, through a prefix of this attempt
    (``TORCHELASTIC_RESTART_COUNT``): with torch 2.13 the ranks restarted after a failure
    (``--max-restarts``) otherwise meet the failed attempt's gloo addresses in the store and
    never connect (checked with a bare two-rank script under torchrun as well). Joined
    :func:`~cli.train_signals.interruptible`: a Ctrl-C stops a rank waiting there for a peer
    that the same Ctrl-C stopped earlier."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "MASTER_ADDR" not in os.environ:
        interruptible(lambda: dist.init_process_group(backend))
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")

    def join() -> None:
        agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, False)
        store = dist.PrefixStore(f"mfsdp/attempt_{attempt}", agent)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world)

    interruptible(join)


def _report_refusal(message: str, rank: int, grace: float) -> None:
    """Print a refusal once per job: rank 0 prints it. Every rank of a job refuses the same flags,
    and the first rank to exit makes torchrun stop the others, so a rank other than 0 that exited
    at once could take rank 0 down before it printed (the job would end without a word). It waits
    instead, and torchrun stops it when rank 0 exits; still alive after the grace period, the
    refusal was its own (rank 0 went on), and it prints it."""
    if rank != 0:
        time.sleep(grace)
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
