"""How ``transformers`` models' parameters lie in a Hugging Face model directory, for checkpoints
whose tensors carry the model's own names (model source kind ``transformers``).

Most parameters are written under their module names. transformers 5 keeps each MoE layer's
experts in two fused 3-D parameters, ``mlp.experts.gate_up_proj`` ``(E, 2F, H)`` (each expert's
gate rows, then its up rows) and ``mlp.experts.down_proj`` ``(E, H, F)``, but ``save_pretrained``
writes (and ``from_pretrained`` reads) the per-expert layout of the hub's checkpoints. Checked
against transformers 5.24's own ``save_pretrained`` (tests/mfsdp_ckpt/hf/test_transformers_layout.py):

* ``mixtral``: ``….block_sparse_moe.experts.N.w1.weight`` (gate), ``w3`` (up), ``w2`` (down),
  and every ``.mlp.`` of a name becomes ``.block_sparse_moe.`` (the router too);
* ``qwen2_moe``, ``qwen3_moe``: ``….mlp.experts.N.gate_proj.weight``, ``up_proj``, ``down_proj``.

:func:`disk_tensors` gives, for one parameter, the tensors on disk and how each is a view of it
(whole rows of one expert: split and merged bitwise). The trainer's ``--hf-model`` loader
(:func:`check_weights`, :func:`load_weights`) and ``export-hf`` of a ``transformers`` checkpoint
both use it, so the two agree by construction. Nothing here imports ``transformers``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from mfsdp_ckpt.errors import ConversionError
from mfsdp_ckpt.hf.expert_families import FUSED_LAYOUTS, FusedExperts
from mfsdp_ckpt.hf.files import HFDirectory, read_regular_file
from mfsdp_ckpt.hf.mapping import Conversion, Rule

__all__ = [
    "FusedExperts",
    "FUSED_LAYOUTS",
    "DiskTensor",
    "disk_tensors",
    "is_fused_expert",
    "disk_layout",
    "check_weights",
    "load_weights",
    "CARRIED_FILES",
    "carried_files",
    "has_weights",
    "PieceRule",
    "export_conversions",
    "checked_carried_name",
]


#: files of a model directory that travel with its weights: into every checkpoint of a run
#: started from it (``extra.hf_files``), and out again with ``export-hf``; plus ``tokenizer*``
CARRIED_FILES = (
    "generation_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
#: the largest carried file (real tokenizers are a few to tens of megabytes)
MAX_CARRIED_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class DiskTensor:
    """One tensor on disk made from a parameter: its name, shape, and the view of the (contiguous)
    parameter holding its elements."""

    name: str
    shape: tuple[int, ...]
    view: Callable[[torch.Tensor], torch.Tensor]


def is_fused_expert(name: str, shape: tuple[int, ...]) -> bool:
    """Whether the parameter ``name`` (module fqn) is a fused 3-D expert tensor."""
    return len(shape) == 3 and (name.endswith(".experts.gate_up_proj") or name.endswith(".experts.down_proj"))


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t


def _expert(e: int, lo: int, hi: int) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda t: t[e, lo:hi]


def disk_tensors(model_type: str, name: str, shape: tuple[int, ...]) -> list[DiskTensor] | None:
    """The tensors ``save_pretrained`` writes for the parameter ``name`` of ``shape`` in a model of
    ``model_type``, in the order it writes them per expert. None: a fused expert tensor of a
    family this module does not know (its on-disk names are unknown)."""
    shape = tuple(shape)
    layout = FUSED_LAYOUTS.get(model_type)
    if not is_fused_expert(name, shape):
        if layout is not None and layout.rename is not None:
            return [DiskTensor(name.replace(*layout.rename), shape, _whole)]
        return [DiskTensor(name, shape, _whole)]
    if layout is None:
        return None
    prefix = name.rsplit(".", 1)[0]  # …experts
    if layout.rename is not None:
        prefix = prefix.replace(*layout.rename)
    experts, rows, cols = shape
    if name.endswith("gate_up_proj"):
        half = rows // 2
        out = []
        for e in range(experts):
            out.append(DiskTensor(f"{prefix}.{e}.{layout.gate}.weight", (half, cols), _expert(e, 0, half)))
            out.append(DiskTensor(f"{prefix}.{e}.{layout.up}.weight", (half, cols), _expert(e, half, rows)))
        return out
    return [DiskTensor(f"{prefix}.{e}.{layout.down}.weight", (rows, cols), _expert(e, 0, rows)) for e in range(experts)]


def disk_layout(model_type: str, shapes: dict[str, tuple[int, ...]], where: str) -> dict[str, list[DiskTensor]]:
    """Every parameter's tensors on disk (parameter name -> its :class:`DiskTensor` s).
    ConversionError naming ``where`` for a fused expert tensor of a family whose on-disk names
    are unknown, or two parameters claiming one disk name."""
    out: dict[str, list[DiskTensor]] = {}
    owner: dict[str, str] = {}
    for name, shape in shapes.items():
        pieces = disk_tensors(model_type, name, shape)
        if pieces is None:
            known = ", ".join(FUSED_LAYOUTS)
            raise ConversionError(
                f"{where}: model_type {model_type!r} keeps fused expert tensors ({name}) whose names in "
                f"a Hugging Face directory are not known here (known: {known})"
            )
        for piece in pieces:
            if piece.name in owner:
                raise ConversionError(f"{where}: {name} and {owner[piece.name]} would both be stored as {piece.name}")
            owner[piece.name] = name
        out[name] = pieces
    return out


def has_weights(path: str) -> bool:
    """Whether the model directory ``path`` holds safetensors weights (or an index of them)."""
    try:
        return any(n.endswith(".safetensors") or n == "model.safetensors.index.json" for n in os.listdir(path))
    except OSError:
        return False


def _config_fields(config: dict[str, Any], values: Iterable[int]) -> str:
    """``field=value`` for each integer field of ``config`` whose value is one of ``values``."""
    wanted = set(values)
    hits = [
        f"{k}={v}" for k, v in sorted(config.items()) if isinstance(v, int) and not isinstance(v, bool) and v in wanted
    ]
    return f" ({', '.join(hits)})" if hits else ""


def check_weights(
    directory: HFDirectory,
    layout: dict[str, list[DiskTensor]],
    config: dict[str, Any],
    ignorable: Callable[[str], bool] = lambda name: False,
) -> None:
    """Refuse, before any parameter is touched, a directory whose tensors do not match the model
    its ``config.json`` builds: one ConversionError line naming the file, the tensor, and the
    config fields behind the expected shape. ``ignorable``: disk names the model may lack
    (e.g. ``lm_head.weight`` of a tied model, which some writers store anyway)."""
    expected = {piece.name: piece.shape for pieces in layout.values() for piece in pieces}
    config_path = os.path.join(directory.path, "config.json")
    for name, shape in expected.items():
        stored = directory.tensors.get(name)
        if stored is None:
            continue
        if tuple(stored.shape) != tuple(shape):
            differing = (
                [d for d, s in zip(shape, stored.shape) if d != s] if len(shape) == len(stored.shape) else list(shape)
            )
            raise ConversionError(
                f"{os.path.join(directory.path, stored.file)}: {name} is {tuple(stored.shape)}, but {config_path} makes it "
                f"{tuple(shape)}{_config_fields(config, differing)}"
            )
        if not (stored.dtype.is_floating_point):
            raise ConversionError(
                f"{os.path.join(directory.path, stored.file)}: {name} is {stored.dtype}, not a floating-point weight"
            )
    missing = sorted(n for n in expected if n not in directory.tensors)
    if missing:
        more = f" (+{len(missing) - 3} more)" if len(missing) > 3 else ""
        raise ConversionError(
            f"{directory.path}: the weights lack {', '.join(missing[:3])}{more}, which {config_path} "
            "makes part of the model"
        )
    unexpected = sorted(n for n in directory.tensors if n not in expected and not ignorable(n))
    if unexpected:
        more = f" (+{len(unexpected) - 3} more)" if len(unexpected) > 3 else ""
        file = os.path.join(directory.path, directory.tensors[unexpected[0]].file)
        raise ConversionError(
            f"{file}: {', '.join(unexpected[:3])}{more}: not a parameter of the model {config_path} builds"
        )


def load_weights(directory: HFDirectory, layout: dict[str, list[DiskTensor]], params: dict[str, torch.Tensor]) -> None:
    """Read every parameter's tensors from ``directory`` into place (checked first with
    :func:`check_weights`): straight into the parameter's memory where the dtypes agree (bitwise),
    else read and cast."""
    for name, pieces in layout.items():
        target = params[name]
        for piece in pieces:
            view = piece.view(target)
            stored = directory.tensors[piece.name]
            if stored.dtype == target.dtype and view.is_contiguous():
                directory.read(piece.name, out=view)
            else:
                view.copy_(directory.read(piece.name).view(view.shape))


def carried_files(path: str) -> dict[str, bytes]:
    """The files of the model directory ``path`` that travel with its weights (file name ->
    bytes): :data:`CARRIED_FILES` and every ``tokenizer*`` file, those present."""
    try:
        names = sorted(os.listdir(path))
    except OSError as e:
        raise ConversionError(f"{path}: cannot list the directory ({e.strerror or e})") from None
    out: dict[str, bytes] = {}
    for name in names:
        if name in CARRIED_FILES or (name.startswith("tokenizer") and not name.endswith(".safetensors")):
            full = os.path.join(path, name)
            if os.path.isfile(full):
                out[name] = read_regular_file(full, "file carried with the model", MAX_CARRIED_BYTES)
    return out


@dataclass(frozen=True)
class PieceRule(Rule):
    """The export rule of one parameter of a ``transformers`` checkpoint: its tensors on disk, as
    views of it (:func:`disk_tensors`). The model config is not needed (``c`` is ignored)."""

    pieces: tuple[DiskTensor, ...] = ()

    def their_shapes(self, shape: torch.Size, c: Any) -> list[torch.Size]:
        return [torch.Size(p.shape) for p in self.pieces]

    def views(self, tensor: torch.Tensor, c: Any) -> list[torch.Tensor]:
        return [p.view(tensor) for p in self.pieces]


def export_conversions(model_type: str, shapes: dict[str, torch.Size], where: str) -> list[Conversion]:
    """The conversions of an export of a ``transformers`` checkpoint whose model tensors are
    ``shapes`` (checkpoint key ``model.<fqn>`` -> shape), in key order."""
    by_fqn = {key[len("model.") :]: tuple(shape) for key, shape in sorted(shapes.items())}
    layout = disk_layout(model_type, by_fqn, where)
    out = []
    for fqn, pieces in layout.items():
        rule = PieceRule(ours=f"model.{fqn}", theirs=tuple(p.name for p in pieces), pieces=tuple(pieces))
        out.append(Conversion(rule, rule.ours, rule.theirs))
    return out


def checked_carried_name(name: Any, where: str) -> str:
    """``name`` if it is a file name a checkpoint may carry (:func:`carried_files`' rule, a plain
    name inside the directory), else ConversionError naming ``where``."""
    if (
        not isinstance(name, str)
        or not name
        or os.sep in name
        or (os.altsep and os.altsep in name)
        or name in (".", "..")
        or not (name in CARRIED_FILES or name.startswith("tokenizer"))
        or name.endswith(".safetensors")
    ):
        raise ConversionError(f"{where}: {name!r} is not a file name a model directory carries")
    return name
