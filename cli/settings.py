"""The trainer's settings, typed: one frozen :class:`Settings` per run, made once from the parsed
command line (``cli.train_args.check_flags`` validates the namespace into it), with one section per
group of ``mfsdp-train --help`` and per section of a ``--config`` file (``[model]``,
``[parallelism]``, ``[precision]``, ``[optimizer]``, ``[training]``, ``[data]``, ``[checkpoint]``,
``[logging]``, ``[launch]``). Each field is named as its flag's attribute (``--batch-size`` is
``settings.training.batch_size``); a test checks that the sections hold exactly the parser's flags.

Nothing here changes while the run goes on. What the run starts from, which rank 0 decides once a
process group exists (``--resume``'s ``latest`` or ``auto`` resolved, the checkpoint checked), is a
value of its own: :class:`StartPoint`.

Imports nothing but the standard library: the launcher builds these before any rank starts,
without torch.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ModelSettings",
    "ParallelismSettings",
    "PrecisionSettings",
    "OptimizerSettings",
    "TrainingSettings",
    "DataSettings",
    "CheckpointSettings",
    "LoggingSettings",
    "LaunchSettings",
    "Origin",
    "Settings",
    "StartPoint",
    "FRESH",
    "SECTIONS",
    "settings_of",
]


@dataclass(frozen=True)
class ModelSettings:
    """``[model]``: which model to train (at most one of the first four is set: ``check_flags``
    refuses more), and the LoRA adapters to fine-tune it with."""

    model: str | None = None  # a preset's name
    model_config: str | None = None  # a GPTConfig / manifest / config.json file
    hf_model: str | None = None  # a Hugging Face model directory
    mcore_config: str | None = None  # a Megatron-Core arguments file
    lora: str | None = None  # r=8,alpha=16,targets=q_proj,v_proj (cli.lora)


@dataclass(frozen=True)
class ParallelismSettings:
    """``[parallelism]``: how the model is sharded over the ranks."""

    strategy: str = "optim_grads_params"
    policy: str = "even"
    ep: int = 1
    dp_replicate: int = 1
    hfsdp: bool = False
    moe_aux_loss: str = "local"
    comm_stream: bool = False


@dataclass(frozen=True)
class PrecisionSettings:
    """``[precision]``: MXFP8 weights and the compute dtype."""

    mxfp8: str | None = None  # the element format (e4m3, e5m2), None: off
    mx_rule: str = "floor"
    param_dtype: str = "float32"  # --dtype, as a torch dtype name


@dataclass(frozen=True)
class OptimizerSettings:
    """``[optimizer]``: which optimizer, and what only Muon has."""

    optimizer: str = "adamw"
    muon_lr: float = 0.02
    ns_dtype: str = "bfloat16"


@dataclass(frozen=True)
class TrainingSettings:
    """``[training]``: the run's length, batch, schedule and seed."""

    steps: int = 100
    stop_at: int | None = None
    batch_size: int = 12
    micro_batches: int = 1
    seq_len: int = 64
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup: int = 10
    weight_decay: float = 0.01
    clip: float = 1.0
    seed: int = 0


@dataclass(frozen=True)
class DataSettings:
    """``[data]``: a token file, or (``data`` None) the synthetic stream."""

    data: str | None = None
    data_dtype: str = "uint16"


@dataclass(frozen=True)
class CheckpointSettings:
    """``[checkpoint]``: where checkpoints go, and what the flags ask to start from. ``resume`` is
    the flag's value as given (a path, ``cli.run_config.LATEST`` or ``AUTO``), never rewritten: the
    checkpoint a run does start from is its :class:`StartPoint`."""

    ckpt_dir: str | None = None
    save_every: int = 0
    keep: int | None = None
    async_save: bool = False
    resume: str | None = None
    allow_change: tuple[str, ...] = ()
    init_from: str | None = None
    mem_tier: str | None = None  # the node-memory tier's directory (a tmpfs), None: off
    mem_every: int = 1
    mem_keep: int = 2
    mem_replicas: int = 1
    node_size: int | None = None  # ranks per node of the memory tier (None: the launcher's local world size)
    mem_keep_on_exit: bool = False


@dataclass(frozen=True)
class LoggingSettings:
    """``[logging]``: metrics, curves, how often to log, and third-party output."""

    metrics: str | None = None
    tensorboard: str | None = None
    log_every: int = 1
    verbose: bool = False


@dataclass(frozen=True)
class LaunchSettings:
    """``[launch]``: how ``--nproc-per-node`` starts the ranks (torchrun's flags, passed on)."""

    nproc_per_node: int | None = None
    nnodes: str | None = None
    node_rank: str | None = None
    rdzv_backend: str | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    rdzv_conf: str | None = None
    master_addr: str | None = None
    master_port: str | None = None
    max_restarts: str | None = None
    shutdown_timeout: int = 120


@dataclass(frozen=True)
class Origin:
    """Where values that the command line did not give came from, so that a refusal can name the
    file: ``recorded`` the attributes taken from the resumed checkpoint's manifest ``recorded_in``,
    ``in_file`` those only the ``--config`` file ``set_in`` set."""

    recorded_in: str | None = None
    recorded: frozenset[str] = frozenset()
    set_in: str | None = None
    in_file: frozenset[str] = frozenset()


#: section name (the ``--help`` group and the ``--config`` file's section) -> its dataclass
SECTIONS: dict[str, type] = {
    "model": ModelSettings,
    "parallelism": ParallelismSettings,
    "precision": PrecisionSettings,
    "optimizer": OptimizerSettings,
    "training": TrainingSettings,
    "data": DataSettings,
    "checkpoint": CheckpointSettings,
    "logging": LoggingSettings,
    "launch": LaunchSettings,
}


@dataclass(frozen=True)
class Settings:
    """Every setting of one run, by section, and where the values came from. Frozen: made once
    (:func:`settings_of`), read by everything after."""

    model: ModelSettings = field(default_factory=ModelSettings)
    parallelism: ParallelismSettings = field(default_factory=ParallelismSettings)
    precision: PrecisionSettings = field(default_factory=PrecisionSettings)
    optimizer: OptimizerSettings = field(default_factory=OptimizerSettings)
    training: TrainingSettings = field(default_factory=TrainingSettings)
    data: DataSettings = field(default_factory=DataSettings)
    checkpoint: CheckpointSettings = field(default_factory=CheckpointSettings)
    logging: LoggingSettings = field(default_factory=LoggingSettings)
    launch: LaunchSettings = field(default_factory=LaunchSettings)
    config: str | None = None  # the --config file read, if any
    origin: Origin = field(default_factory=Origin)

    def values(self) -> dict[str, Any]:
        """Every setting by flag attribute, sections flattened (``allow_change`` a list, as the
        parser gives it): what the namespace held, and what ``run_config`` records from."""
        out: dict[str, Any] = {"config": self.config}
        for name in SECTIONS:
            for f in dataclasses.fields(getattr(self, name)):
                value = getattr(getattr(self, name), f.name)
                out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    def shown(self, dest: str, flag: str) -> str:
        """``--flag VALUE`` as a refusal names it, with the file it came from when that is not the
        command line: the resumed checkpoint's manifest or the ``--config`` file."""
        text = f"{flag} {self.values()[dest]}"
        if dest in self.origin.recorded:
            return f"{text} (recorded in {self.origin.recorded_in})"
        return f"{text} (set in {self.origin.set_in})" if dest in self.origin.in_file else text


def settings_of(args: argparse.Namespace) -> Settings:
    """The frozen settings of a parsed command line (``cli.train_args.parse_args``'s namespace,
    with its ``_recorded_in`` and ``_set_in``); no checks (``check_flags`` makes them)."""
    sections: dict[str, Any] = {}
    for name, cls in SECTIONS.items():
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)}
        if name == "checkpoint":
            values["allow_change"] = tuple(values["allow_change"] or ())
        sections[name] = cls(**values)
    recorded_in, recorded = getattr(args, "_recorded_in", (None, set()))
    set_in, in_file = getattr(args, "_set_in", (None, set()))
    origin = Origin(recorded_in, frozenset(recorded), set_in, frozenset(in_file))
    return Settings(**sections, config=getattr(args, "config", None), origin=origin)


@dataclass(frozen=True)
class StartPoint:
    """The checkpoint the run starts from, decided once for every rank (by rank 0: ``latest`` may
    move meanwhile) and checked (written for this model, and under ``--resume`` with this run's
    recorded settings): ``flag`` ``"--resume"`` (continue it: weights, optimizer, step, data
    position) or ``"--init-from"`` (its weights only), ``path`` the checkpoint directory; both None
    for a fresh start. ``snapshot``: under ``--mem-tier``, the run's newest snapshot in memory when
    it is at least as new as ``path`` (then None when the run has no durable checkpoint yet): the
    ranks recover the newest whole snapshot and fall back to ``path``."""

    flag: str | None = None
    path: str | None = None
    snapshot: str | None = None

    @property
    def resumes(self) -> bool:
        """Whether the run continues a checkpoint (``--resume``), rather than starting at step 0."""
        return self.flag == "--resume"


FRESH = StartPoint()  # a run from step 0 and freshly initialised weights
