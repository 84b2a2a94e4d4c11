"""The trainer's command line, without torch: ``mfsdp-train --help``, ``--version`` and a usage
error answer from here at once, and the launcher decides with it, before any rank starts, what
the flags alone refuse (:func:`check_flags`). Nothing here imports torch, ``mfsdp_core`` or
``mfsdp_ckpt`` at module level; reading a resumed checkpoint's recorded settings does, and only
when ``--resume`` names one.

The model presets, strategies, the default placement policy and the token-file dtypes are named
here as plain strings (``--help`` lists them); a test checks that they are the runtime's.
"""

from __future__ import annotations

import argparse
import difflib
import importlib.metadata
import os
import sys
from typing import Any, NoReturn

from .lora import parse_lora, peft_missing
from .run_config import AUTO, LATEST, allowed_changes, local_missing, recorded_settings
from .settings import CheckpointSettings, Settings, settings_of
from .train_config import NOT_CARRIED, ConfigError, config_argv
from .train_launch import add_launch_arguments
from .train_outputs import refused_output
from .train_tensorboard import tensorboard_missing

__all__ = [
    "UsageError",
    "TrainerParser",
    "build_parser",
    "parse_args",
    "DEFAULT_PRESET",
    "PRESET_NAMES",
    "STRATEGY_NAMES",
    "DEFAULT_STRATEGY",
    "DEFAULT_POLICY",
    "TOKEN_DTYPE_NAMES",
    "MODEL_FLAGS",
    "check_flags",
    "check_local_writable",
    "world_size_of",
]

#: ``mfsdp_core.models.gpt.PRESETS``, ``mfsdp_core.strategy.STRATEGY_NAMES``, ``mfsdp_core.plan``'s
#: defaults, ``mfsdp_core.data.TOKEN_DTYPES`` and a checkpoint's own files by name
#: (tests/cli/test_train_flows.py checks them)
PRESET_NAMES = ("tiny", "tiny-moe", "llama-like-small", "qwen3-like-small", "mixtral-like-small", "tiny-deepseek")
DEFAULT_PRESET = "tiny"
STRATEGY_NAMES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
DEFAULT_STRATEGY = "optim_grads_params"
DEFAULT_POLICY = "even"
TOKEN_DTYPE_NAMES = ("uint16", "uint32")
CHECKPOINT_FILES = ("mfsdp.json", ".metadata")  # mfsdp_ckpt's MANIFEST_NAME and METADATA_NAME
#: the flags that name a model, each excluding the others (argparse attribute -> flag)
MODEL_FLAGS = {
    "model": "--model",
    "model_config": "--model-config",
    "hf_model": "--hf-model",
    "mcore_config": "--mcore-config",
}


class UsageError(Exception):
    """Bad flags or a request that cannot be met: one line on stderr, non-zero exit."""


_LATEST, _AUTO = LATEST, AUTO  # --resume without a path; --resume auto


class TrainerParser(argparse.ArgumentParser):
    """The trainer's parser: a usage error is one line, printed once (by rank 0 of a job), with the
    closest flag for a misspelt one; ``raising=True`` raises it instead (to check config entries)."""

    def __init__(self, *args: Any, raising: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.raising = raising

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        message = _with_suggestions(message, list(self._option_string_actions))
        if self.raising:
            raise ConfigError(message)
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {message} (mfsdp-train --help lists the flags)", file=sys.stderr, flush=True)
        sys.exit(2)


def _with_suggestions(message: str, options: list[str]) -> str:
    """argparse's message, with the closest known flag of each unknown ``--flag``."""
    if not message.startswith("unrecognized arguments:"):
        return message
    hints = []
    for word in message.split(":", 1)[1].split():
        close = difflib.get_close_matches(word.split("=", 1)[0], options, n=1) if word.startswith("--") else []
        hints += [f"{word}: did you mean {close[0]}?"] if close else []
    return message + (f" ({'; '.join(hints)})" if hints else "")


class _DefaultsShown(argparse.HelpFormatter):
    """``--help`` says each flag's default, where its help does not already."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        unshown = default is None or default is False or default == [] or default == argparse.SUPPRESS
        if "default" in text or not action.option_strings or unshown:  # (0 is shown: 0 == False, but not `is`)
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


def build_parser(raising: bool = False) -> TrainerParser:
    """The trainer's command line (``parse_args`` parses with it); its argument groups are the
    sections of a ``--config`` file."""
    p = TrainerParser(
        prog="mfsdp-train",
        description="Resumable sharded training of a reference GPT, a "
        "Hugging Face transformers causal LM or a Megatron-Core GPTModel.",
        formatter_class=_DefaultsShown,
        raising=raising,
    )
    p.add_argument("--version", action="version", version=f"mfsdp-train {_version()}")
    p.add_argument(
        "--config",
        default=None,
        metavar="FILE.toml",
        help="read settings from this TOML file (flat, or in sections named as the groups below); "
        "flags on the command line override it",
    )
    _add_model_arguments(p.add_argument_group("model"))
    _add_parallelism_arguments(p.add_argument_group("parallelism"))
    _add_precision_arguments(p.add_argument_group("precision"))
    _add_optimizer_arguments(p.add_argument_group("optimizer"))
    _add_schedule_arguments(p.add_argument_group("training"))
    _add_data_arguments(p.add_argument_group("data"))
    _add_checkpoint_arguments(p.add_argument_group("checkpoint"))
    _add_logging_arguments(p.add_argument_group("logging"))
    add_launch_arguments(p.add_argument_group("launch"))
    return p


def _version() -> str:
    try:
        return importlib.metadata.version("mfsdp-ckpt")
    except importlib.metadata.PackageNotFoundError:  # a checkout that was never installed
        return "unknown (not installed)"


def _add_model_arguments(p: argparse._ActionsContainer) -> None:
    """Which model to train: a preset, a config file, a Hugging Face directory or an MCore config
    (``cli.model_source`` turns them into a model source)."""
    p.add_argument(
        "--model",
        default=None,
        help=f"model preset: {', '.join(PRESET_NAMES)} (default: the config recorded in the --init-from or --resume "
        f"checkpoint, else {DEFAULT_PRESET})",
    )
    p.add_argument(
        "--model-config",
        default=None,
        metavar="FILE.json",
        help="model config file instead of a preset: GPTConfig fields, a checkpoint manifest, or a Hugging "
        "Face config.json of a known architecture",
    )
    p.add_argument(
        "--hf-model",
        default=None,
        metavar="DIR",
        help="train the Hugging Face transformers causal LM of this model directory (config.json, with or "
        "without safetensors weights; weights are loaded when present); needs transformers",
    )
    p.add_argument(
        "--mcore-config",
        default=None,
        metavar="FILE.json",
        help="train a Megatron-Core GPTModel built from this JSON (Megatron-LM argument names and/or "
        "TransformerConfig fields, as import-mcore --config reads); needs pip install 'mfsdp-ckpt[mcore]'",
    )
    p.add_argument(
        "--lora",
        default=None,
        metavar="r=R,alpha=A,targets=M1,M2[,dropout=P]",
        help="fine-tune LoRA adapters of rank R (scale A/R) on the linear modules named M1, M2, ... (PEFT's "
        "target_modules), every other weight frozen; transformers models only; needs pip install "
        "'mfsdp-ckpt[lora]'. Recorded in the checkpoints: --resume needs it not again",
    )


def _add_parallelism_arguments(p: argparse._ActionsContainer) -> None:
    """How the model is sharded over the ranks: the FSDP strategy, the placement policy and the
    expert-parallel size."""
    p.add_argument("--strategy", default=DEFAULT_STRATEGY, help=", ".join(STRATEGY_NAMES))
    p.add_argument("--policy", default=DEFAULT_POLICY, help="even, row, block(N) or tensor")
    p.add_argument(
        "--ep",
        type=int,
        default=1,
        metavar="E",
        help="expert parallelism: E ranks share each layer's experts (E divides the world size and "
        "the expert count); experts are sharded over the world size / E ranks holding the same ones",
    )
    p.add_argument(
        "--dp-replicate",
        type=int,
        default=1,
        metavar="R",
        help="HSDP: R replica groups of world size / R ranks; dense parameters are sharded inside a "
        "group and replicated across the groups (gradients all-reduced across them)",
    )
    p.add_argument(
        "--hfsdp",
        action="store_true",
        help="with --dp-replicate: shard the optimizer state and main params across the replicas too",
    )
    p.add_argument(
        "--moe-aux-loss",
        default="local",
        choices=["local", "global"],
        help="MoE load-balancing loss over this rank's tokens (local), or over the whole batch of every "
        "rank, token counts all-reduced (global: the loss and gradients do not depend on the layout)",
    )
    p.add_argument(
        "--comm-stream",
        action="store_true",
        help="GPU only: issue all-gathers and reduce-scatters from one CUDA stream of their own, so "
        "prefetches do not wait behind queued compute (docs/runtime.md)",
    )


def _add_precision_arguments(p: argparse._ActionsContainer) -> None:
    """The number formats the model stores and computes in: MXFP8 weights and the compute dtype."""
    p.add_argument(
        "--mxfp8",
        nargs="?",
        const="e4m3",
        default=None,
        choices=["e4m3", "e5m2"],
        metavar="ELEMENT",
        help="store the transformer layers' linear weights as MXFP8 (elements e4m3, the default, or e5m2): "
        "sharded on whole 32-row blocks, quantized locally after each step, gathered as MX planes",
    )
    p.add_argument(
        "--mx-rule",
        default="floor",
        choices=["floor", "rceil"],
        help="MXFP8 scale rule: OCP floor (default) or NVIDIA rceil",
    )
    p.add_argument(
        "--dtype",
        "--param-dtype",
        dest="param_dtype",
        default="float32",
        type=_compute_dtype,
        metavar="{fp32,bf16}",
        help="dtype the model computes in: fp32, or bf16 for mixed precision "
        "(main params, optimizer state and gradient reduction stay fp32)",
    )


def _add_optimizer_arguments(p: argparse._ActionsContainer) -> None:
    """The optimizer (AdamW, Muon or plain SGD) and the settings only Muon has."""
    p.add_argument(
        "--optimizer",
        default="adamw",
        choices=["adamw", "muon", "sgd"],
        help="adamw; muon: Muon for the hidden matrices (whole under --policy tensor, owner-computed "
        "under flat policies) and AdamW for embeddings, output layer and vectors; sgd: plain SGD (no "
        "momentum; --weight-decay applies), whose step is a linear function of the gradient",
    )
    p.add_argument(
        "--muon-lr", type=float, default=0.02, help="peak learning rate of the Muon matrices (same schedule)"
    )
    p.add_argument("--ns-dtype", default="bfloat16", choices=["bfloat16", "float32"], help="Muon's Newton-Schulz dtype")


def _add_schedule_arguments(p: argparse._ActionsContainer) -> None:
    """The length of the run, the batch, the learning-rate schedule and the other training
    hyperparameters (all but ``--stop-at`` recorded in the run config that ``--resume`` compares)."""
    p.add_argument("--steps", type=int, default=100, help="total steps of the run (the LR schedule spans them)")
    p.add_argument(
        "--stop-at", type=int, default=None, help="exit after this step, with a checkpoint (as a job time limit would)"
    )
    p.add_argument("--batch-size", type=int, default=12, help="global batch in sequences (split over ranks)")
    p.add_argument("--micro-batches", type=int, default=1, help="gradient accumulation steps per step")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--min-lr", type=float, default=3e-4, help="learning rate at the end of the cosine decay")
    p.add_argument("--warmup", type=int, default=10, help="linear warm-up steps")
    p.add_argument("--weight-decay", type=float, default=0.01, help="decoupled weight decay of the 2-D weights")
    p.add_argument("--clip", type=float, default=1.0, help="max global gradient norm")
    p.add_argument("--seed", type=int, default=0, help="model init and data seed")


def _add_data_arguments(p: argparse._ActionsContainer) -> None:
    """Where the samples come from: a token file, or (by default) the synthetic stream."""
    p.add_argument(
        "--data",
        default=None,
        metavar="PATH",
        help="train on a tokenized corpus: one flat binary file of token ids, no header (nanoGPT's train.bin, "
        "the .bin of Megatron's preprocessing), memory-mapped and cut into --seq-len windows shuffled "
        "per epoch by --seed; the position is checkpointed (default: a synthetic token stream)",
    )
    p.add_argument("--data-dtype", default="uint16", choices=TOKEN_DTYPE_NAMES, help="the token id type of --data")


def _add_checkpoint_arguments(p: argparse._ActionsContainer) -> None:
    """Saving checkpoints, and starting a run from one (``--resume`` continues a run,
    ``--init-from`` starts one from its weights)."""
    p.add_argument(
        "--ckpt-dir",
        default=None,
        help="checkpoint directory: a local path, or an object-store URL such as s3://bucket/run "
        "(endpoint and credentials from the environment: FSSPEC_S3_ENDPOINT_URL, AWS_*)",
    )
    p.add_argument(
        "--save-every",
        type=int,
        default=0,
        help="with --ckpt-dir: save every N steps, and at the end (0: at the end only)",
    )
    p.add_argument("--keep", type=int, default=None, help="keep only the newest K checkpoints (default: keep all)")
    p.add_argument(
        "--async-save",
        action="store_true",
        help="save asynchronously: go on training while the state is copied to host memory and written "
        "(at most one save in flight; logs each save's blocking and total seconds)",
    )
    p.add_argument(
        "--resume",
        nargs="?",
        const=_LATEST,
        default=None,
        metavar="CKPT",
        help="continue from CKPT (e.g. the output of mfsdp-ckpt reshard), or without CKPT from "
        "<ckpt-dir>/latest; 'auto': from <ckpt-dir>/latest when it exists, else start fresh; at any "
        "world size. Refused when a flag that changes the samples or the math differs from the run's",
    )
    p.add_argument(
        "--allow-change",
        action="append",
        default=[],
        metavar="FLAG",
        help="with --resume: accept a new value of this recorded flag (e.g. lr); repeatable",
    )
    p.add_argument(
        "--init-from",
        default=None,
        metavar="CKPT",
        help="start from the model weights of this checkpoint (e.g. from mfsdp-ckpt import-hf): "
        "fresh optimizer, step 0, any world size",
    )
    p.add_argument(
        "--mem-tier",
        default=None,
        metavar="DIR",
        help="with --ckpt-dir: also snapshot the run into each node's memory (DIR on a tmpfs, e.g. "
        "/dev/shm/mfsdp), replicated to peer nodes; a restart (--max-restarts, --resume auto) "
        "recovers from the newest whole snapshot, falling back to --ckpt-dir",
    )
    p.add_argument("--mem-every", type=int, default=1, metavar="N", help="with --mem-tier: snapshot every N steps")
    p.add_argument("--mem-keep", type=int, default=2, metavar="K", help="with --mem-tier: snapshots kept per node")
    p.add_argument(
        "--mem-replicas",
        type=int,
        default=1,
        metavar="R",
        help="with --mem-tier: peer nodes that keep a copy of each node's snapshot files",
    )
    p.add_argument(
        "--node-size",
        type=int,
        default=None,
        metavar="M",
        help="with --mem-tier: ranks per node (default: the ranks per machine); a smaller M lets one "
        "machine play several nodes, each with its own tier directory under DIR",
    )
    p.add_argument(
        "--mem-keep-on-exit",
        action="store_true",
        help="with --mem-tier: keep the snapshots when the run ends (default: removed at a normal end)",
    )


def _add_logging_arguments(p: argparse._ActionsContainer) -> None:
    """What the run reports besides its log: per-step metrics, curves, how often it logs, and
    whether third-party libraries may speak too."""
    p.add_argument("--metrics", default=None, help="append one JSON line per step (exact floats) to this file")
    p.add_argument(
        "--tensorboard",
        default=None,
        metavar="DIR",
        help="also write TensorBoard event files (loss, lr, grad-norm, tokens/s, step and save times) to DIR; "
        "needs the tensorboard package",
    )
    p.add_argument("--log-every", type=int, default=1, help="log a line every N steps (and the last one)")
    p.add_argument("--verbose", action="store_true", help="show third-party libraries' warnings and logs")


#: settings of where checkpoints go: a resumed run takes the recorded ones only with a --ckpt-dir
DESTINATION = frozenset(
    {"save_every", "keep", "async_save", "mem_tier", "mem_every", "mem_keep", "mem_replicas", "mem_keep_on_exit"}
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The run's settings: the command line over the ``--config`` file over what a resumed
    checkpoint recorded over the defaults (:mod:`cli.train_config`). ``args._recorded_in`` is
    ``(manifest path, the attributes taken from it)``, ``args._set_in`` ``(config file, the
    attributes only it set)``: where a refusal says a value came from."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    first = parser.parse_args(argv)
    words: list[str] = []
    if first.config:
        try:
            words = config_argv(first.config, parser, build_parser(raising=True))
        except ConfigError as e:
            parser.error(str(e))
    args = parser.parse_args([*words, *argv])
    where, saved = _recorded_defaults(args, parser)
    if saved:
        parser.set_defaults(**saved)
        args = parser.parse_args([*words, *argv])
    args._recorded_in = (where, set(saved) - given_flags(argv, words))
    args._set_in = (first.config, given_flags([], words) - given_flags(argv, []) if words else set())
    return args


def _recorded_defaults(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[str | None, dict[str, Any]]:
    """The settings the checkpoint that ``--resume`` names recorded, as this run's defaults (and the
    manifest they come from): those of one invocation (``NOT_CARRIED``) apart, and those of where
    checkpoints go (``DESTINATION``) apart unless this run has a ``--ckpt-dir`` (a resume from a
    path alone saves nothing)."""
    where, settings = recorded_settings(args)  # reads the manifest (imports the checkpoint layer)
    known = {a.dest for a in parser._actions}
    skipped = NOT_CARRIED if args.ckpt_dir else NOT_CARRIED | DESTINATION
    return where, {k: v for k, v in settings.items() if k in known and k not in skipped}


_DTYPE_NAMES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16"}


def _compute_dtype(name: str) -> str:
    if name not in _DTYPE_NAMES:
        raise argparse.ArgumentTypeError(f"{name!r}: one of fp32, bf16 (or float32, bfloat16)")
    return _DTYPE_NAMES[name]


def given_flags(argv: list[str], words: list[str]) -> set[str]:
    """The attributes the command line or the ``--config`` file set (``words``: the file's, as
    command-line words): what a refusal may name as the user's own."""
    parser = build_parser()
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    try:
        return set(vars(parser.parse_args([*words, *argv])))
    except SystemExit:  # not reached: the same words parsed before
        return set()


def world_size_of(args: argparse.Namespace) -> int | None:
    """The world size the launcher will start: ``--nproc-per-node`` x ``--nnodes`` when both are
    plain numbers (an elastic ``MIN:MAX`` leaves it to the rendezvous: None)."""
    nnodes = args.nnodes or "1"
    if args.nproc_per_node is None or not nnodes.isdigit():
        return None
    return args.nproc_per_node * int(nnodes)


def check_flags(args: argparse.Namespace, world: int | None) -> Settings:
    """The run's settings (:class:`cli.settings.Settings`, frozen), after refusing
    (:class:`UsageError`, one line) what the flags decide alone, with the local files they name:
    the launcher calls it before any rank starts (``world`` None when it cannot know it), each
    rank again first thing (``cli.trainer.check_args``), so one rule decides both. The rules that
    need the model or the start checkpoint are ``cli.train_start``'s (the launcher applies them
    too, through ``cli.train_preflight``, where it can read what the run names)."""
    settings = settings_of(args)
    ckpt, logging = settings.checkpoint, settings.logging
    _check_destination(settings)
    _check_start(settings)
    if (refused := refused_output(settings)) is not None:  # an output over, into or around an input
        raise UsageError(refused)
    if world is not None:
        _check_layout(settings, world)
        _check_tier_layout(settings, world)
    _check_lora(settings)
    if settings.parallelism.hfsdp and settings.parallelism.dp_replicate == 1:
        raise UsageError("--hfsdp needs --dp-replicate R with R > 1 (it shards the optimizer across the replicas)")
    try:
        allowed_changes(list(ckpt.allow_change))
    except ValueError as e:
        raise UsageError(str(e)) from None
    if ckpt.allow_change and not ckpt.resume:
        raise UsageError("--allow-change is for --resume (a fresh run has nothing to compare with)")
    if logging.tensorboard:  # the package, and a directory the events can go to
        check_local_writable(logging.tensorboard, "--tensorboard")
        if (missing := tensorboard_missing()) is not None:
            raise UsageError(missing)
    return settings


def _check_lora(settings: Settings) -> None:
    """``--lora``: a spec that parses, PEFT installed, and nothing it cannot go with yet."""
    if settings.model.lora is None:
        return
    try:
        parse_lora(settings.model.lora)
    except ValueError as e:
        where = settings.shown("lora", "--lora").removeprefix(f"--lora {settings.model.lora}")  # " (set in FILE)"
        raise UsageError(f"{e}{where}") from None
    if (missing := peft_missing()) is not None:
        raise UsageError(missing)
    if settings.precision.mxfp8:
        raise UsageError("--lora with --mxfp8: not supported (the frozen weights would be MXFP8 planes)")


def _check_destination(settings: Settings) -> None:
    """Where checkpoints go: what needs a ``--ckpt-dir``, and a local one that can be written."""
    ckpt: CheckpointSettings = settings.checkpoint
    if not ckpt.ckpt_dir:
        if ckpt.resume in (_LATEST, _AUTO):
            what = "--resume auto" if ckpt.resume == _AUTO else "--resume without a checkpoint path"
            raise UsageError(f"{what} needs --ckpt-dir (it resumes from <ckpt-dir>/latest), or name one: --resume CKPT")
        for dest, flag in (
            ("save_every", "--save-every"),
            ("keep", "--keep"),
            ("async_save", "--async-save"),
            ("mem_tier", "--mem-tier"),
        ):
            if getattr(ckpt, dest):
                named = flag if dest == "async_save" else settings.shown(dest, flag)
                raise UsageError(f"{named} needs --ckpt-dir (without one the run saves nothing)")
        _refuse_tier_flags_without_tier(settings)
        return
    if ckpt.mem_tier is not None:
        _check_mem_tier(settings)
    else:
        _refuse_tier_flags_without_tier(settings)
    if "://" not in ckpt.ckpt_dir or ckpt.ckpt_dir.startswith("file://"):
        check_local_writable(ckpt.ckpt_dir.removeprefix("file://"), "--ckpt-dir")


def _check_mem_tier(settings: Settings) -> None:
    """The memory tier's flags: counts that make sense, and a local directory that can be written."""
    ckpt = settings.checkpoint
    for dest, flag, least in (
        ("mem_every", "--mem-every", 1),
        ("mem_keep", "--mem-keep", 1),
        ("mem_replicas", "--mem-replicas", 0),
        ("node_size", "--node-size", 1),
    ):
        value = getattr(ckpt, dest)
        if value is not None and value < least:
            raise UsageError(f"{settings.shown(dest, flag)}: must be at least {least}")
    if "://" in ckpt.mem_tier:
        raise UsageError(f"--mem-tier {ckpt.mem_tier}: must be a local directory (a tmpfs such as /dev/shm/...)")
    check_local_writable(ckpt.mem_tier, "--mem-tier")


#: the memory tier's flags that mean nothing without ``--mem-tier``, and their defaults
TIER_FLAGS = {
    "mem_every": ("--mem-every", 1),
    "mem_keep": ("--mem-keep", 2),
    "mem_replicas": ("--mem-replicas", 1),
    "node_size": ("--node-size", None),
    "mem_keep_on_exit": ("--mem-keep-on-exit", False),
}


def _refuse_tier_flags_without_tier(settings: Settings) -> None:
    """A memory tier's flag given without ``--mem-tier`` cannot take effect: refused, as
    ``--save-every`` without ``--ckpt-dir`` is."""
    for dest, (flag, default) in TIER_FLAGS.items():
        if getattr(settings.checkpoint, dest) != default:
            named = flag if dest == "mem_keep_on_exit" else settings.shown(dest, flag)
            raise UsageError(f"{named} needs --mem-tier (without one the run keeps no snapshots in memory)")


def _check_tier_layout(settings: Settings, world: int) -> None:
    """The memory tier's nodes over a job of ``world`` ranks: ``--node-size`` must be at most the
    ranks of a machine, and divide them when the job has several machines (a node's ranks share its
    tier directory, so a node cannot span machines; on one machine the last node may be smaller), and
    ``--mem-replicas`` must be a number of peer nodes the job has (R > 1 with fewer than R + 1
    nodes would keep fewer copies than asked; the default 1 on one node keeps none, as the header
    says)."""
    ckpt = settings.checkpoint
    if ckpt.mem_tier is None or not ckpt.ckpt_dir:
        return
    per_machine = settings.launch.nproc_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world) or world)
    node_size = ckpt.node_size or per_machine
    if ckpt.node_size is not None and ckpt.node_size > per_machine:
        raise UsageError(
            f"{settings.shown('node_size', '--node-size')}: more than the {per_machine} ranks of a machine "
            "(a node's ranks share its tier directory, so a node cannot span machines)"
        )
    if ckpt.node_size is not None and world > per_machine and per_machine % ckpt.node_size:
        raise UsageError(
            f"{settings.shown('node_size', '--node-size')}: must divide the {per_machine} ranks of each machine "
            "(a node's ranks share its tier directory, so a node cannot span machines)"
        )
    nodes = -(-world // node_size)
    if ckpt.mem_replicas > max(nodes - 1, 1):
        peers = "no peer" if nodes == 1 else f"{nodes - 1} peer node{'s' if nodes > 2 else ''}"
        raise UsageError(
            f"{settings.shown('mem_replicas', '--mem-replicas')}: the job has {nodes} node(s) of {node_size} ranks, "
            f"so {peers} can keep a copy of a node's files (--node-size makes one machine play several nodes)"
        )


def check_local_writable(path: str, flag: str) -> None:
    """Refuse unless the local ``path`` is, or could be created as, a directory this process may
    write (creating nothing: a refused run leaves no directory behind)."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise UsageError(f"{flag} {path}: {probe} is not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path}: {probe} is not writable")


def _check_start(settings: Settings) -> None:
    """What the run starts from: one way of naming the model, one of ``--resume`` and
    ``--init-from``, and a local checkpoint path that exists."""
    model, ckpt = settings.model, settings.checkpoint
    given = [flag for dest, flag in MODEL_FLAGS.items() if getattr(model, dest) is not None]
    if len(given) > 1:
        raise UsageError(f"{' and '.join(given)} exclude each other (name the model one way)")
    if model.model is not None and model.model not in PRESET_NAMES:  # as mfsdp_core's get_preset says it
        raise UsageError(f"unknown model preset {model.model!r}; expected one of {', '.join(sorted(PRESET_NAMES))}")
    if ckpt.resume and ckpt.init_from:
        raise UsageError(
            "--resume and --init-from exclude each other (--resume continues a run; --init-from starts one)"
        )
    for flag, path in (("--resume", ckpt.resume), ("--init-from", ckpt.init_from)):
        if path and path not in (_LATEST, _AUTO) and local_missing(path):
            raise UsageError(f"{flag}: {os.path.abspath(path)}: no such checkpoint")
        if path and path not in (_LATEST, _AUTO) and _hf_model_dir(path):
            raise UsageError(
                f"{flag} {path}: a Hugging Face model directory (config.json, *.safetensors), not a checkpoint; "
                f"train it with --hf-model {path}, or make a checkpoint of it with 'mfsdp-ckpt import-hf {path} OUT'"
            )
    if ckpt.resume == _LATEST and ckpt.ckpt_dir and not ckpt.mem_tier and local_missing(ckpt.ckpt_dir):
        raise UsageError(f"--resume: no checkpoint to resume from (--ckpt-dir {ckpt.ckpt_dir} does not exist)")


def _check_layout(settings: Settings, world: int) -> None:
    """The numbers that must divide the world size: ``--ep``, ``--dp-replicate`` and the batch."""
    ep, replicas = settings.parallelism.ep, settings.parallelism.dp_replicate
    micro, batch = settings.training.micro_batches, settings.training.batch_size
    if ep < 1 or world % ep:
        what = f"must be >= 1, got {ep}" if ep < 1 else f"does not divide the world size {world}"
        raise UsageError(f"--ep {ep}: EP size {ep} {what}")
    if replicas < 1:
        raise UsageError(f"--dp-replicate {replicas}: the replica count must be >= 1")
    if world % replicas:
        raise UsageError(f"--dp-replicate {replicas}: {replicas} replicas do not divide the world size {world}")
    if micro < 1 or batch % (world * micro):
        raise UsageError(
            f"{settings.shown('batch_size', '--batch-size')} must be a multiple of world size x --micro-batches "
            f"({world} x {micro})"
        )


def _hf_model_dir(path: str) -> bool:
    """Whether the local ``path`` is a Hugging Face model directory rather than a checkpoint: a
    ``config.json`` beside ``*.safetensors`` files and no manifest (``mfsdp.json``) or ``.metadata``."""
    try:
        names = set(os.listdir(path)) if os.path.isdir(path) else set()
    except OSError:
        return False
    checkpoint = set(CHECKPOINT_FILES) & names
    return "config.json" in names and any(n.endswith(".safetensors") for n in names) and not checkpoint
