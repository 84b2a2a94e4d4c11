"""Import a Hugging Face model directory as a committed canonical checkpoint, streaming.

``config.json`` becomes our model config (every field we cannot express is named in one error);
the safetensors headers are checked against the mapping (missing, unexpected and misshapen
tensors, all named) before a byte of data is read; then each conversion reads its HF tensors one
at a time (``safetensors.safe_open``), merges them, and appends the result to the checkpoint
being built. Nothing is visible at the destination until the checkpoint commits.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..errors import ConversionError, raise_key_problems
from ..manifest import versions, writer_layout
from ..streaming import CheckpointBuilder
from .files import HFDirectory
from .mapping import check_against, default_plan, expand
from .registry import architecture_of_hf_config, architectures, get_architecture

__all__ = ["import_", "ImportResult"]


@dataclass
class ImportResult:
    path: str
    architecture: str
    tensors: int
    bytes: int
    model_config: dict[str, Any]
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def import_(
    hf_dir: str | os.PathLike,
    checkpoint: str | os.PathLike,
    *,
    arch: str | None = None,
    overwrite: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> ImportResult:
    """Convert the HF model directory ``hf_dir`` (``config.json`` plus safetensors, sharded or
    not) into a committed canonical checkpoint at ``checkpoint``: ``model.<fqn>`` weights in their
    HF dtype and the model config in the manifest (``model_config``), ready for
    ``python -m cli.train --init-from`` or :func:`mfsdp_ckpt.load` at any world size.

    ``arch``: an architecture name; default: from ``config.json``'s ``model_type``. Every HF
    tensor must be consumed exactly once and every parameter of the model written exactly once;
    otherwise a :class:`~mfsdp_ckpt.errors.ConversionError` names the keys and nothing is
    written. ``progress(done, total)`` gets bytes converted so far. One process.
    """
    start = time.perf_counter()
    with HFDirectory(hf_dir) as hf:
        source = hf.path
        if arch is None:
            architecture = architecture_of_hf_config(hf.config, source)
        else:
            architecture = get_architecture(arch)
            model_type = hf.config.get("model_type")
            known = {a.model_type for a in architectures().values()}
            if model_type in known and model_type != architecture.model_type:
                raise ConversionError(f"{source}: config.json says model_type {model_type!r}, --arch says {arch!r}")
        cfg = architecture.from_hf_config(hf.config, source)
        problems = architecture.unsupported(cfg)
        if problems:  # a from_hf_config that accepted what its own rules cannot map: a bug there
            raise ConversionError(f"{source}: {architecture.name}: {'; '.join(problems)}")
        conversions = expand(architecture, cfg)
        shapes = check_against(conversions, cfg, architecture)
        plan = default_plan(cfg)

        planned: dict[str, torch.Size] = {}
        for conv in conversions:
            planned.update(zip(conv.theirs, conv.rule.their_shapes(shapes[conv.ours], cfg)))
        present = hf.tensors
        missing = sorted(set(planned) - set(present))
        unexpected = sorted(set(present) - set(planned))
        misshapen = sorted(f"{k} (file {tuple(present[k].shape)}, config {tuple(planned[k])})"
                           for k in set(planned) & set(present) if present[k].shape != planned[k])
        mixed = sorted(conv.ours for conv in conversions
                       if len({present[k].dtype for k in conv.theirs if k in present}) > 1)
        raise_key_problems(source, [
            ("missing tensors", missing),
            (f"unexpected tensors (no mapping in {architecture.name})", unexpected),
            ("shape mismatch", misshapen),
            ("pieces of one tensor in different dtypes", mixed),
        ], ConversionError)

        manifest = {
            "writer": writer_layout(1, plan),  # so that reshard can place ranges
            "model_config": cfg.to_dict(),
            "step": None,
            "include_grads": False,
            "has_optimizer": False,
            "versions": versions(),
            "converted_from": source,
            "hf": {"architecture": architecture.name, "model_type": hf.config.get("model_type")},
        }
        total = sum(present[k].shape.numel() * torch.empty((), dtype=present[k].dtype).element_size() for k in planned)
        done = 0
        consumed: Counter[str] = Counter()
        written: Counter[str] = Counter()
        with CheckpointBuilder(checkpoint, manifest, overwrite=overwrite) as builder:
            for conv in conversions:
                pieces = []
                for key in conv.theirs:
                    pieces.append(hf.read(key))
                    consumed[key] += 1
                    done += pieces[-1].numel() * pieces[-1].element_size()
                tensor = conv.rule.merge(pieces, cfg)
                del pieces
                if tensor.shape != shapes[conv.ours]:
                    raise ConversionError(f"{source}: {conv.ours} came out {tuple(tensor.shape)}, expected {tuple(shapes[conv.ours])}")
                builder.add_tensor(conv.ours, tensor)
                written[conv.ours] += 1
                del tensor
                if progress is not None:
                    progress(done, total)
            wrong = sorted([k for k in present if consumed[k] != 1] + [k for k in shapes if written[k] != 1])
            if wrong:
                raise ConversionError(f"{source}: not consumed / written exactly once: {', '.join(wrong)}")
            path = builder.commit()
    return ImportResult(path=path, architecture=architecture.name, tensors=len(conversions), bytes=total,
                        model_config=cfg.to_dict(), seconds=time.perf_counter() - start)
