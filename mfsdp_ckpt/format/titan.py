"""torchtitan's checkpoint key layout ⇄ canonical keys: names only, no I/O.

torchtitan's ``CheckpointManager`` saves one flat DCP state dict (``dcp.save`` of
``{**model.state_dict(), "optimizer": ..., "lr_scheduler": ..., "dataloader": ..., "train_state": ...}``):

- the model under its bare state-dict names (``tok_embeddings.weight``; a module's state-dict
  hooks may rename: the fused ``wqkv`` is saved as ``wq``/``wk``/``wv``);
- ``optimizer.state.<fqn>.<state>``: the optimizers' state, by parameter name (``wqkv``, not its
  state-dict names: the optimizer sees parameters);
- ``optimizer.param_groups.<fqn>.<hp>``: every hyper-parameter of every parameter, one entry each
  (``OptimizersContainer`` flattens the groups by parameter name);
- ``lr_scheduler.*``, ``train_state.*`` and ``dataloader.*`` (``dp_rank_<r>``, one per
  data-parallel rank, and ``world_size``): the trainer's own state, which only torchtitan reads.

Canonically (:mod:`mfsdp_ckpt.format.keys`) these are ``model.<name>``, ``optim.<fqn>.<state>``,
one ``optim.param_groups`` and, kept verbatim, the trainer's entries (group ``other``). The
layout is recognised from the names (:func:`is_titan_layout`), so no flag is needed to read it.
"""

from __future__ import annotations

from typing import Any, Collection, Iterable

from mfsdp_ckpt.errors import CheckpointError
from mfsdp_ckpt.format.keys import GROUPS, MAIN_PARAM, PARAM_GROUPS, model_key

__all__ = [
    "TITAN_LAYOUT",
    "TITAN_STATE",
    "TITAN_GROUPS",
    "TRAINER_ENTRIES",
    "STEP_KEY",
    "is_titan_layout",
    "is_trainer_entry",
    "titan_to_canonical",
    "to_titan_key",
    "titan_param_group_entries",
    "row_chunks",
    "non_model_entries",
]

#: the manifest's ``key_layout`` of a checkpoint we write in torchtitan's layout
TITAN_LAYOUT = "torchtitan"
TITAN_STATE = "optimizer.state."
TITAN_GROUPS = "optimizer.param_groups."
#: the heads of torchtitan's own trainer state: kept verbatim, read by torchtitan only
TRAINER_ENTRIES = ("lr_scheduler.", "train_state.", "dataloader.")
#: the trainer's step (an int), what ``inspect`` and our manifests call the checkpoint's step
STEP_KEY = "train_state.step"


def is_trainer_entry(key: str) -> bool:
    """Whether ``key`` is torchtitan's trainer state (``lr_scheduler.*``, ``train_state.*``,
    ``dataloader.*``)."""
    return key.startswith(TRAINER_ENTRIES)


def is_titan_layout(names: Collection[str]) -> bool:
    """Whether a checkpoint's entry names (those of one without ``mfsdp.json``, after any key
    map) are torchtitan's: none is canonical (``model.*``, ``optim.*``) and either the trainer's
    state is there or an ``optimizer.state.<fqn>.<state>`` / ``optimizer.param_groups.<fqn>.<hp>``
    entry names a bare entry as its parameter. (Megatron-Core's ``optimizer.state.<state>.<key>``
    names no entry that way; a model-only torchtitan save, bare names alone, is not told from a
    plain ``dcp.save`` and takes ``--key-map '=model.'``.)"""
    if any(n.startswith(("model.", "optim.")) for n in names):
        return False
    for name in names:
        if is_trainer_entry(name):
            return True
        for prefix in (TITAN_STATE, TITAN_GROUPS):
            if name.startswith(prefix) and name[len(prefix) :].rpartition(".")[0] in names:
                return True
    return False


def titan_to_canonical(name: str) -> str | None:
    """The canonical name of torchtitan entry ``name``: ``optim.<fqn>.<state>``, the trainer's
    entries as they are, ``model.<name>`` for the model's; None for the ``optimizer.param_groups``
    entries, which together make ``optim.param_groups``."""
    if name.startswith(TITAN_GROUPS):
        return None
    if name.startswith(TITAN_STATE):
        return "optim." + name[len(TITAN_STATE) :]
    if is_trainer_entry(name) or name.split(".", 1)[0] in GROUPS:
        return name
    return model_key(name)


def to_titan_key(key: str) -> str | None:
    """The torchtitan name of canonical ``key``, or None for what torchtitan has no place for
    (gradients, MX planes, per-rank RNG states, and ``optim.param_groups``: see
    :func:`titan_param_group_entries`). ``optim.<fqn>.main_param`` (the fp32 weights of a
    low-precision model) becomes the model's ``<fqn>``; the trainer's entries, ``extra.*`` and
    any other entry keep their names."""
    head = key.split(".", 1)[0]
    if key == PARAM_GROUPS or head in ("grad", "mx") or key.startswith("extra.rng."):
        return None
    if head == "model":
        return key[len("model.") :]
    if head == "optim":
        fqn, state = key[len("optim.") :].rsplit(".", 1)
        return fqn if state == MAIN_PARAM else f"{TITAN_STATE}{fqn}.{state}"
    return key


def titan_param_group_entries(groups: Any, source: str) -> dict[str, Any]:
    """``optimizer.param_groups.<fqn>.<hp>`` entries, one per parameter and hyper-parameter, from
    the canonical groups (a list of dicts naming their parameters under ``params``), as
    torchtitan's ``OptimizersContainer.state_dict`` lays them out."""
    if not isinstance(groups, list) or not all(
        isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups
    ):
        raise CheckpointError(f"{source}: key '{PARAM_GROUPS}': not a list of parameter groups naming their parameters")
    return {
        f"{TITAN_GROUPS}{fqn}.{hp}": value
        for group in groups
        for fqn in group["params"]
        for hp, value in group.items()
        if hp != "params"
    }


def row_chunks(rows: int, world_size: int) -> list[tuple[int, int]]:
    """Rows ``[start, end)`` of a tensor's dim 0 on each of ``world_size`` ranks as FSDP2's
    ``fully_shard`` (``Shard(0)``, ``torch.chunk``) places them: ``ceil(rows / world_size)`` each,
    the last ones short or empty. What torchtitan rank ``r`` reads of every sharded tensor."""
    step = -(-rows // world_size) if rows else 0
    return [(min(r * step, rows), min((r + 1) * step, rows)) for r in range(world_size)]


def non_model_entries(renamed: Iterable[tuple[str, str]], objects: Collection[str]) -> list[str]:
    """Of ``(stored key, name after the key map)`` pairs, the stored keys a rule would file as
    model weights that are not: the optimizer's (``optimizer.*``, ``optim.*``), torchtitan's
    trainer state, our own groups' (``grad``, ``mx``, ``extra``), and any object (``objects``:
    the stored keys that are not tensors)."""
    heads = ("optimizer.", "optim.", "grad.", "mx.", "extra.", *TRAINER_ENTRIES)
    return sorted(
        key
        for key, name in renamed
        if name.startswith("model.") and not key.startswith("model.") and (key.startswith(heads) or key in objects)
    )
