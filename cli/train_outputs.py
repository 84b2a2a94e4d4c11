"""The trainer's outputs kept apart from its inputs, decided from the flags before any rank starts
(:func:`refused_output`, asked by ``cli.train_args.check_flags``); without torch.

Outputs: ``--ckpt-dir`` (a run directory: the trainer adds ``step_*`` checkpoints, ``latest`` and
its lock there and removes only its own old checkpoints), ``--metrics FILE`` (appended to) and
``--tensorboard DIR`` (event files added). Inputs: the checkpoint ``--resume`` or ``--init-from``
names (with the ``latest`` pointer followed to it), ``--data``, ``--hf-model``, ``--model-config``,
``--mcore-config`` and ``--config``.

No output may *be* an input or *lie inside* one: a checkpoint saved into the checkpoint it resumes,
metrics appended to the token file or to a checkpoint's ``mfsdp.json``, events written into the
Hugging Face model directory. ``--metrics`` may not *contain* one either. The two directory outputs
may: ``--ckpt-dir D --resume D/step_000010`` (or ``--resume`` alone, ``D/latest``) is how a run
continues, and a token file or config kept in the run directory is left alone, since the trainer
only adds entries beside it.
"""

from __future__ import annotations

import os

from .run_config import AUTO, LATEST, is_local
from .settings import Settings

__all__ = ["refused_output", "run_inputs"]


def _checkpoint(path: str) -> list[str]:
    """What a checkpoint flag reads: the checkpoint and the ``latest`` pointer followed to it
    (a local path; a URL as it is, so that refusing costs no request)."""
    if not is_local(path):
        return [path]
    from mfsdp_ckpt.read.inputs import checkpoint_inputs

    return checkpoint_inputs(path.removeprefix("file://"))


def run_inputs(settings: Settings) -> dict[str, list[str]]:
    """Every input the flags name, by what it is (``"the --data file"``) -> its paths."""
    ckpt, model = settings.checkpoint, settings.model
    resume = ckpt.resume
    if resume in (LATEST, AUTO):  # <ckpt-dir>/latest
        resume = os.path.join(ckpt.ckpt_dir, "latest") if ckpt.ckpt_dir and is_local(ckpt.ckpt_dir) else None
    inputs = {
        "the --resume checkpoint": _checkpoint(resume) if resume else [],
        "the --init-from checkpoint": _checkpoint(ckpt.init_from) if ckpt.init_from else [],
    }
    for path, what in (
        (settings.data.data, "the --data file"),
        (model.hf_model, "the --hf-model directory"),
        (model.model_config, "the --model-config file"),
        (model.mcore_config, "the --mcore-config file"),
        (settings.config, "the --config file"),
    ):
        inputs[what] = [path] if path else []
    return inputs


def refused_output(settings: Settings) -> str | None:
    """The one-line refusal of an output that is or lies inside an input, or of a ``--metrics``
    file that contains one (naming the flag and the input); None when every output is apart.
    Reads at most a ``latest`` pointer; creates and changes nothing."""
    outputs = [
        (flag, path, relations)
        for flag, path, relations in (
            ("--ckpt-dir", settings.checkpoint.ckpt_dir, ("is", "lies inside")),
            ("--metrics", settings.logging.metrics, ("is", "lies inside", "contains")),
            ("--tensorboard", settings.logging.tensorboard, ("is", "lies inside")),
        )
        if path
    ]
    if not outputs:
        return None
    from mfsdp_ckpt.errors import CheckpointError
    from mfsdp_ckpt.tools import check_apart

    inputs = run_inputs(settings)
    for flag, path, relations in outputs:
        try:
            check_apart(path, inputs, name=flag, refuse=relations)
        except CheckpointError as e:
            return str(e)
    return None
