"""The launcher's pre-flight beyond the flags: :func:`check_start` checks the run's model, its
``--data`` file and the start checkpoint it can read (a local path, or a local ``--ckpt-dir``'s
latest) before any rank starts, with the rules the ranks apply (``cli.train_start``).

Describing a reference GPT run, reading a manifest and sizing a token file import no torch, so
such a refusal takes a fraction of a second. An ``--hf-model`` directory's config.json is checked
torch-free first (``--ep`` included, for the families ``mfsdp_ckpt.hf.expert_families`` knows), then
built by transformers (seconds; the ranks would pay it too); a Megatron-Core config file is checked torch-free
(the model itself, and a model only an object-store checkpoint records, are left to the ranks)."""

from __future__ import annotations

from .run_config import is_local
from .settings import CheckpointSettings, Settings
from .train_args import _AUTO, _LATEST

__all__ = ["check_start", "needs_start_check"]


def _start_is_local(ckpt: CheckpointSettings) -> bool | None:
    """Whether the checkpoint the run starts from is one the launcher can read (None: it names none)."""
    if ckpt.init_from:
        return is_local(ckpt.init_from)
    if ckpt.resume in (_LATEST, _AUTO):
        return is_local(ckpt.ckpt_dir)
    if ckpt.resume:
        return is_local(ckpt.resume)
    return None


def needs_start_check(settings: Settings) -> bool:
    """Whether the launcher checks the run's model and start beyond the flags: always, except for a
    Megatron-Core model (its library is the ranks' to import) that starts from no local checkpoint,
    and a model named by nothing but an object-store checkpoint."""
    local, model = _start_is_local(settings.checkpoint), settings.model
    if model.hf_model is not None:
        return True
    if model.mcore_config is not None:
        return local is True
    named = model.model is not None or model.model_config is not None
    return local is not False or named


def check_start(settings: Settings, world: int | None) -> None:
    """Refuse (``UsageError``, one line) a model, data file or start checkpoint the ranks would
    refuse, before they start: called by the launcher after ``check_flags``."""
    from .train_start import check_mcore_file, preflight

    if settings.model.mcore_config is not None:
        check_mcore_file(settings.model.mcore_config, settings.launch.nproc_per_node)
    if not needs_start_check(settings):
        return
    from .quiet import quiet_third_party

    quiet_third_party(settings.logging.verbose)  # building an --hf-model source imports transformers: our lines only
    preflight(settings, world)
