"""Upcycling: a dense checkpoint of the reference GPT becomes an MoE checkpoint whose experts are
copies of the dense MLP (Megatron-Core's "upcycling"), streamed one tensor at a time.

Per layer, the dense ``mlp.linear_fc1.layer_norm_weight`` becomes ``pre_mlp_layernorm.weight``,
``mlp.linear_fc1.weight`` (``[gate; up]``, ``[2F, H]``) and ``mlp.linear_fc2.weight`` (``[H, F]``)
become every expert's ``mlp.experts.linear_fc{1,2}.weight{e}``, and a new ``mlp.router.weight``
``[E, H]`` is drawn from N(0, 0.02²) (seeded). Everything else is copied unchanged.

Why the MoE model computes the dense model's function at step 0: with softmax routing and the
top-k weights renormalised to sum to 1 (``moe_score_func="softmax"``, no
``moe_router_pre_softmax``), identical experts give ``sum_k w_k * MLP(x) = MLP(x)`` for any
router weights; the random router breaks the symmetry once training starts.

Granular upcycling (``granularity=G``): expert ``e`` holds slice ``s = e % G`` of the FFN
dimension (rows ``s*F/G … (s+1)*F/G`` of gate and of up, the same columns of fc2, fc2 scaled by
G); the G experts ``j*G … j*G+G-1`` form group ``j`` and share one router row. Their scores are
then equal, so top-``K`` (``K = G*k``) picks ``k`` whole groups (up to exact ties between groups),
each expert of group ``j`` weighted ``p_j / (G * P)`` with ``P`` the sum of the ``k`` chosen group
scores, and the output is ``sum_j (p_j / P) * sum_s f_s(x) = MLP(x)``, ``f_s`` being slice ``s``
of the dense MLP (SwiGLU splits exactly over the FFN dimension).

The optimizer state is dropped: the result holds weights only (train from it with
``--init-from``, which starts a fresh optimizer). A source trained in low precision contributes
its fp32 main params (``optim.<fqn>.main_param``), as ``load`` and ``export-hf`` read them.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from mfsdp_ckpt.errors import ConversionError, raise_key_problems
from mfsdp_ckpt.format.checksum import payload_crc32c
from mfsdp_ckpt.format.keys import MAIN_PARAM, group_of, model_key, optim_key
from mfsdp_ckpt.format.manifest import versions, writer_layout
from mfsdp_ckpt.format.model_source import gpt_source
from mfsdp_ckpt.hf.registry import architectures
from mfsdp_ckpt.model.shape import ModelShape, default_plan, meta_model, recorded_shape
from mfsdp_ckpt.progress import progress_adder
from mfsdp_ckpt.read.mapped import MappedReader
from mfsdp_ckpt.read.reader import compact
from mfsdp_ckpt.storage import fs
from mfsdp_ckpt.tools.upcycle_spec import MAX_EXPERTS, UpcycleSpec, check_upcycle_spec
from mfsdp_ckpt.write.builder import CheckpointBuilder
from mfsdp_ckpt.write.destination import destination_for

__all__ = [
    "UpcycleSpec",
    "UpcycleResult",
    "ROUTER_INIT_STD",
    "EXACT_MOE_FIELDS",
    "MAX_EXPERTS",
    "moe_config",
    "upcycle",
]

#: standard deviation of the routers' normal initialisation (Megatron-Core's ``init_method_std``
#: default, and the reference model's initialisation of every 2-D weight)
ROUTER_INIT_STD = 0.02

#: a dense MLP's parameters: ``<layer>.mlp.linear_fc1.layer_norm_weight`` (its fused norm) and
#: ``<layer>.mlp.linear_fc{1,2}.weight``, ``<layer>`` the transformer layer holding it
_MLP = re.compile(r"(?P<layer>.+)\.mlp\.linear_fc(?P<fc>[12])\.(?P<what>weight|layer_norm_weight)")

#: the MoE fields upcycling sets: the values under which the MoE model
#: computes the dense one (softmax scores, top-k renormalised and not scaled, no shared expert, no
#: group-limited routing or expert bias, every layer MoE). Fields a dense config does not use, so
#: whatever the source recorded for them says nothing about the MoE model.
EXACT_MOE_FIELDS: dict[str, Any] = {
    "moe_score_func": "softmax",
    "moe_router_pre_softmax": False,
    "moe_shared_expert_ffn_hidden_size": 0,
    "moe_shared_expert_gate": False,
    "moe_router_topk_scaling_factor": 1.0,
    "moe_router_num_groups": 0,
    "moe_router_group_topk": 0,
    "moe_router_enable_expert_bias": False,
    "first_k_dense_replace": 0,
}


@dataclass(frozen=True)
class UpcycleResult:
    """What :func:`upcycle` wrote: the checkpoint, its tensor count and tensor bytes, the MoE
    model config, the source entries left out (optimizer state, trainer state, MX planes, ...)."""

    path: str
    tensors: int
    bytes: int
    model_config: dict[str, Any]
    dropped: list[str]
    seconds: float

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def moe_config(dense: ModelShape, spec: UpcycleSpec) -> ModelShape:
    """The MoE model config of ``dense`` upcycled by ``spec``: E experts of size F / G, top-K,
    :data:`EXACT_MOE_FIELDS` (softmax routing with renormalised top-k weights, no shared expert:
    what makes the upcycled model exact); every other field kept."""
    return dataclasses.replace(
        dense,
        num_experts=spec.num_experts,
        moe_router_topk=spec.topk,
        moe_ffn_hidden_size=dense.ffn_hidden_size // spec.granularity,
        **EXACT_MOE_FIELDS,
    )


def _moe_shape(src: str, dense: ModelShape, spec: UpcycleSpec) -> ModelShape:
    """:func:`moe_config`, a config the model refuses named in one line with ``src``."""
    try:
        return moe_config(dense, spec)
    except (TypeError, ValueError) as e:
        raise ConversionError(f"{src}: the upcycled model config is not valid: {e}") from None


def _upcycled_bytes(reader: MappedReader, sources: dict[str, str], moe: ModelShape, spec: UpcycleSpec) -> int:
    """The tensor bytes the upcycled checkpoint holds, from the source's shapes alone: each dense
    MLP weight ``E / G`` times, a router ``[E, H]`` per MLP layer, the rest once."""
    total = 0
    for name, key in sources.items():
        nbytes = math.prod(reader.shape(key)) * reader.dtype(key).itemsize
        mlp = _MLP.fullmatch(name)
        total += nbytes * spec.num_experts // spec.granularity if mlp and mlp.group("what") == "weight" else nbytes
    layers = _mlp_layers(reader, sources)
    return total + sum(moe.num_experts * moe.hidden_size * dtype.itemsize for dtype in layers.values())


def _free_bytes(dst: str) -> tuple[str, int] | None:
    """(the nearest existing folder of a local ``dst``, its free bytes); None for a remote one."""
    return destination_for(dst).free_bytes()


def _check_room(src: str, dst: str, nbytes: int, spec: UpcycleSpec) -> None:
    """Refuse, naming --num-experts, an upcycled checkpoint larger than the free space where it
    goes (before its plan, a key per expert, is built)."""
    free = _free_bytes(dst)
    if free is not None and nbytes > free[1]:
        raise ConversionError(
            f"{src}: --num-experts {spec.num_experts}: the upcycled checkpoint needs {nbytes / 2**30:.1f} GiB, "
            f"{free[0]} has {free[1] / 2**30:.1f} GiB free"
        )


def _dense_shape(reader: MappedReader, spec: UpcycleSpec) -> ModelShape:
    """The dense model config the source records, refused (naming the source) when it records
    none, is already MoE, or has an FFN size the granularity does not divide."""
    src = reader.directory
    dense = recorded_shape(reader.manifest, src, "upcycle")
    if dense.num_experts > 0:
        raise ConversionError(
            f"{src}: already an MoE model (num_experts={dense.num_experts}); upcycle takes a dense checkpoint"
        )
    f, g = dense.ffn_hidden_size, spec.granularity
    if f % g:
        raise ConversionError(f"{src}: --granularity {g} does not divide the FFN size ffn_hidden_size={f}")
    return dense


def _source_keys(reader: MappedReader, dense: ModelShape) -> dict[str, str]:
    """For every parameter of the dense model, the stored entry its weights come from (its fp32
    main params when the checkpoint holds them, else ``model.<fqn>``), after checking, in one
    error naming every problem, that the ``model.*`` entries are exactly the model's parameters
    in their shapes."""
    stored = set(reader.keys())
    params = {name: p.shape for name, p in meta_model(dense).named_parameters()}
    out, misshapen = {}, []
    for name, shape in params.items():
        main = optim_key(name, MAIN_PARAM)
        key = main if main in stored else model_key(name)
        if key not in stored:
            continue
        if not reader.is_tensor(key) or reader.shape(key) != shape:
            what = "an object" if not reader.is_tensor(key) else tuple(reader.shape(key))
            misshapen.append(f"{key} (checkpoint {what}, model {tuple(shape)})")
        out[name] = key
    weights = {k for k in stored if group_of(k) == "model"}
    raise_key_problems(
        reader.directory,
        [
            ("missing weights", sorted(model_key(n) for n in params if n not in out)),
            ("weights the model config does not have", sorted(weights - {model_key(n) for n in params})),
            ("shape mismatch", sorted(misshapen)),
        ],
        ConversionError,
    )
    return out


def _fc1_slice(weight: torch.Tensor, s: int, g: int) -> torch.Tensor:
    """Slice ``s`` of ``g`` of a fused ``[gate; up]`` weight ``[2F, H]``: ``[gate_s; up_s]``."""
    if g == 1:
        return weight
    gate, up = weight.chunk(2, dim=0)
    f = gate.shape[0] // g
    return torch.cat([gate[s * f : (s + 1) * f], up[s * f : (s + 1) * f]])


def _fc2_slice(weight: torch.Tensor, s: int, g: int) -> torch.Tensor:
    """Columns of slice ``s`` of ``g`` of an fc2 weight ``[H, F]``, times ``g`` (each expert's
    routing weight is 1/g of its group's)."""
    if g == 1:
        return weight
    f = weight.shape[1] // g
    return weight[:, s * f : (s + 1) * f] * g


def _pieces(name: str, tensor: torch.Tensor, spec: UpcycleSpec) -> Iterator[tuple[list[str], torch.Tensor]]:
    """What dense parameter ``name`` becomes: ``(keys, tensor)`` for each distinct tensor, with
    every key that holds it (one expert slice is held by E / G experts)."""
    mlp = _MLP.fullmatch(name)
    if mlp is None:
        yield [model_key(name)], tensor
        return
    layer, fc, what = mlp.group("layer", "fc", "what")
    if what == "layer_norm_weight":  # the MoE layer's norm is a module of its own
        yield [model_key(f"{layer}.pre_mlp_layernorm.weight")], tensor
        return
    g, cut = spec.granularity, _fc1_slice if fc == "1" else _fc2_slice
    for s in range(g):
        keys = [model_key(f"{layer}.mlp.experts.linear_fc{fc}.weight{e}") for e in range(s, spec.num_experts, g)]
        yield keys, cut(tensor, s, g)


def _mlp_layers(reader: MappedReader, sources: dict[str, str]) -> dict[str, torch.dtype]:
    """The layers holding a dense MLP, in model order, each with its ``linear_fc1.weight``'s
    dtype (its router's)."""
    out = {}
    for name, key in sources.items():
        mlp = _MLP.fullmatch(name)
        if mlp is not None and mlp.group("fc", "what") == ("1", "weight"):
            out[mlp.group("layer")] = reader.dtype(key)
    return out


def _routers(
    layers: dict[str, torch.dtype], hidden: int, spec: UpcycleSpec
) -> Iterator[tuple[list[str], torch.Tensor]]:
    """Every MLP layer's router ``[E, H]``, drawn in model order from one generator seeded with
    ``spec.seed``: E / G rows from N(0, 0.02²) in fp32, each repeated for the G experts of its
    group (identical scores: the group is chosen whole), cast to the dense MLP's dtype."""
    generator = torch.Generator().manual_seed(spec.seed)
    groups = spec.num_experts // spec.granularity
    for layer, dtype in layers.items():
        rows = torch.empty(groups, hidden).normal_(0.0, ROUTER_INIT_STD, generator=generator)
        yield [model_key(f"{layer}.mlp.router.weight")], rows.repeat_interleave(spec.granularity, dim=0).to(dtype)


def _planned(
    reader: MappedReader, sources: dict[str, str], moe: ModelShape, spec: UpcycleSpec
) -> dict[str, torch.Tensor]:
    """Every tensor the upcycled checkpoint gets, by key, as a meta tensor of its shape and dtype,
    worked out from the source's shapes and dtypes alone (no data read)."""
    out = {
        model_key(f"{layer}.mlp.router.weight"): torch.empty(
            moe.num_experts, moe.hidden_size, dtype=dtype, device="meta"
        )
        for layer, dtype in _mlp_layers(reader, sources).items()
    }
    for name, key in sources.items():
        meta = torch.empty(reader.shape(key), dtype=reader.dtype(key), device="meta")
        for keys, piece in _pieces(name, meta, spec):
            out.update(dict.fromkeys(keys, piece))
    return out


def _check_plan(src: str, moe: ModelShape, planned: dict[str, torch.Tensor]) -> None:
    """Refuse, in one error naming every key, a plan whose keys and shapes are not exactly the
    MoE model's parameters (the routers, made here, included)."""
    params = {model_key(n): p.shape for n, p in meta_model(moe).named_parameters()}
    raise_key_problems(
        src,
        [
            ("MoE parameters upcycling does not make", sorted(set(params) - set(planned))),
            ("tensors the MoE model does not have", sorted(set(planned) - set(params))),
            (
                "shapes differ from the MoE model's",
                sorted(k for k in planned if k in params and planned[k].shape != params[k]),
            ),
        ],
        ConversionError,
    )


def _hf_record(source: dict[str, Any], moe: ModelShape) -> dict[str, Any] | None:
    """The source's ``hf`` record when its architecture still expresses the MoE model (none of
    the dense architectures does: export-hf then infers the MoE one from the config), without
    what described the imported files themselves (their dtypes, their quantization)."""
    record = source.get("hf")
    arch = architectures().get((record or {}).get("architecture"))
    if arch is None or arch.unsupported(moe):
        return None
    return {k: v for k, v in record.items() if k not in ("dtypes", "quantization")}


def _manifest(reader: MappedReader, moe: ModelShape, spec: UpcycleSpec) -> dict[str, Any]:
    """The upcycled checkpoint's manifest: the MoE model (config and model source), its default
    placement plan (what ``reshard`` lays it out from), and what it was upcycled from."""
    source = reader.manifest or {}
    config = moe.to_dict()
    out = {
        "writer": writer_layout(1, default_plan(moe)),
        "model_config": config,
        "model_source": gpt_source(config),
        "step": None,
        "include_grads": False,
        "has_optimizer": False,
        "versions": versions(),
        "converted_from": reader.directory,
        "upcycled_from": {
            "path": reader.directory,
            "save_id": source.get("save_id"),
            "step": source.get("step"),
            **dataclasses.asdict(spec),
            "router_init_std": ROUTER_INIT_STD,
        },
    }
    hf = _hf_record(source, moe)
    if hf is not None:
        out["hf"] = hf
    return out


def _stream(
    reader: MappedReader,
    builder: CheckpointBuilder,
    sources: dict[str, str],
    moe: ModelShape,
    spec: UpcycleSpec,
    add: Callable[[int], None],
) -> dict[str, int]:
    """Write the routers, then each dense parameter's pieces, one source tensor in memory at a
    time (each distinct piece checksummed once, then written once per key that holds it);
    returns how many times each key was written."""
    written: dict[str, int] = {}

    def put(keys: list[str], tensor: torch.Tensor) -> None:
        tensor = compact(tensor.detach())
        crc = payload_crc32c(tensor)
        for key in keys:
            builder.start_writeback(builder.add_tensor(key, tensor, crc32c=crc))
            written[key] = written.get(key, 0) + 1
            add(tensor.numel() * tensor.element_size())

    for keys, router in _routers(_mlp_layers(reader, sources), moe.hidden_size, spec):
        put(keys, router)
    for name, key in sources.items():
        tensor = reader.read(key)
        for keys, piece in _pieces(name, tensor, spec):
            put(keys, piece)
        del tensor
    return written


def upcycle(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    num_experts: int,
    topk: int,
    granularity: int = 1,
    seed: int = 0,
    overwrite: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> UpcycleResult:
    """Write the dense checkpoint ``src`` as the MoE checkpoint ``dst`` (see the module
    docstring): ``num_experts`` experts copying the dense MLP (or, with ``granularity`` G, each
    one of G slices of it), top-``topk`` softmax routing renormalised, routers drawn from
    N(0, 0.02²) with ``seed``. The MoE model computes the dense model's function.

    ``src``: any canonical checkpoint (local or fsspec URL, any world size or layout) whose
    manifest records a dense ``model_config``. Refused, one line naming ``src``, before anything
    is written: an MoE source, no model config, weights that are not the config's, E < 1, K
    outside [1, E], E over :data:`MAX_EXPERTS` or a result larger than the free space at ``dst``,
    G not dividing E, K and the FFN size. ``dst`` is committed whole or not at
    all (``overwrite`` replaces an existing checkpoint). ``progress(done, total)`` gets tensor
    bytes written. Memory: one source tensor and one expert slice."""
    start = time.perf_counter()
    spec = UpcycleSpec(num_experts, topk, granularity, seed)
    check_upcycle_spec(fs.normalize(src), spec)
    with MappedReader(src) as reader:
        dense = _dense_shape(reader, spec)
        moe = _moe_shape(reader.directory, dense, spec)
        sources = _source_keys(reader, dense)
        _check_room(reader.directory, fs.normalize(dst), _upcycled_bytes(reader, sources, moe, spec), spec)
        planned = _planned(reader, sources, moe, spec)
        _check_plan(reader.directory, moe, planned)
        nbytes = sum(t.numel() * t.element_size() for t in planned.values())
        add = progress_adder(progress, nbytes)
        manifest = _manifest(reader, moe, spec)
        with CheckpointBuilder(dst, manifest, overwrite=overwrite, sources=(reader.directory,)) as builder:
            written = _stream(reader, builder, sources, moe, spec, add)
            wrong = sorted(k for k in {*planned, *written} if written.get(k) != 1)
            if wrong:
                raise ConversionError(f"{reader.directory}: not written exactly once: {', '.join(wrong)}")
            path = builder.commit()
        dropped = sorted(set(reader.keys()) - set(sources.values()))
    return UpcycleResult(path, len(planned), nbytes, moe.to_dict(), dropped, time.perf_counter() - start)
