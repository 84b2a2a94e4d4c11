"""MXFP8 weights in the Hugging Face bridge: which parameters of a checkpoint are MX (and in which
format), how their rowwise planes travel through the architecture mappings, and the
``quantization_config`` an MX export records and an import reads back.

Convention (see docs/hf.md, "MXFP8 weights"): transformers' ``quant_method: "mxfp8"`` (its
fine-grained FP8 loader with ``weight_block_size [1, 32]`` and ``scale_fmt "ue8m0"``). Each MX
weight is two HF tensors: ``<module>.weight``, the rowwise data ``[M, K]`` in F8_E4M3 / F8_E5M2,
and ``<module>.weight_scale_inv``, the rowwise E8M0 scales ``[M, K/32]`` in F8_E8M0 (the factor
the data is multiplied by to dequantize: ``w = data * 2^(byte - 127)``). transformers records
neither the element format (its loader assumes E4M3) nor the scale rule, so the config carries
them in an extra object, ``mfsdp_mx``, next to the fields transformers reads.

Splitting: the architecture rules (``Direct``, ``FusedQKV``, ``GatedMLP``) cut and reorder rows
only. A rowwise scale covers 32 consecutive elements *of one row*, so any selection of whole rows
of the data, applied to the scale plane's rows too, stays exact. :func:`check_rows_only` proves
this for each rule before an export writes anything (a rule that moved columns would be refused,
naming the tensor).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from mfsdp_ckpt.errors import ConversionError
from mfsdp_ckpt.format.keys import fqn_of_model_key, mx_key
from mfsdp_ckpt.hf.files import short_repr
from mfsdp_ckpt.hf.mapping import Conversion
from mfsdp_ckpt.model.shape import ModelShape, ShapeModel, sharding_units
from mfsdp_core.mx import BLOCK, ELEMENTS, RULES, MXFormat
from mfsdp_core.mx_planes import MX_PLANES
from mfsdp_core.plan import ModelPlan, mx_marked, placement_fn, plan_model

__all__ = [
    "QUANT_METHOD",
    "EXTENSION",
    "SCALE_SUFFIX",
    "E8M0",
    "MXParam",
    "mx_key",
    "mx_params",
    "single_format",
    "scale_name",
    "module_of",
    "check_rows_only",
    "split_rows",
    "quantization_config",
    "parse_quantization_config",
    "mx_plan",
    "element_of_dtype",
]

#: transformers' name for MXFP8 (``AUTO_QUANTIZATION_CONFIG_MAPPING["mxfp8"]``)
QUANT_METHOD = "mxfp8"
#: our object inside ``quantization_config``: what transformers does not record
EXTENSION = "mfsdp_mx"
#: the scale tensor next to ``<module>.weight`` (transformers' fine-grained FP8 naming)
SCALE_SUFFIX = "weight_scale_inv"
E8M0 = torch.float8_e8m0fnu

_ELEMENT_OF_DTYPE = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}


def element_of_dtype(dtype: torch.dtype) -> str | None:
    """``"e4m3"`` / ``"e5m2"`` for the FP8 element dtypes, None for anything else."""
    return _ELEMENT_OF_DTYPE.get(dtype)


@dataclass(frozen=True)
class MXParam:
    """One MX parameter of a checkpoint: its element format (from the planes' dtype) and its
    scale rule (from the manifest's plan; None when the manifest records none)."""

    fqn: str
    element: str
    rule: str | None

    @property
    def fmt(self) -> MXFormat | None:
        """The full format, when the rule is known."""
        return MXFormat(self.element, self.rule) if self.rule is not None else None

    def key(self, plane: str) -> str:
        return mx_key(self.fqn, plane)


def _recorded_formats(manifest: Mapping[str, Any] | None, source: str) -> tuple[dict[str, dict], dict | None]:
    """The ``mx`` entries the manifest records: per parameter (from ``writer.plan.buffers[i].mx``)
    and a global fallback (``writer.mx``: ``{"element", "rule"}``), both unchecked dicts."""
    writer = (manifest or {}).get("writer") or {}
    per_param: dict[str, dict] = {}
    buffers = ((writer.get("plan") or {}).get("buffers")) or []
    for buf in buffers if isinstance(buffers, list) else []:
        if isinstance(buf, dict) and isinstance(buf.get("mx"), dict):
            for fqn in buf.get("params") or []:
                per_param[fqn] = buf["mx"]
    fallback = writer.get("mx")
    if fallback is not None and not isinstance(fallback, dict):
        raise ConversionError(
            f"{source}: manifest writer.mx must be an object {{element, rule}}, got {short_repr(fallback)}"
        )
    return per_param, fallback


def _recorded(entry: dict, fqn: str, element: str, source: str) -> str | None:
    """The rule of one recorded ``mx`` entry, after checking it against the planes' element."""
    try:
        fmt = MXFormat.from_dict(entry)
    except (TypeError, ValueError) as e:
        raise ConversionError(f"{source}: the manifest's mx entry for {fqn} is not a format: {e}") from None
    if fmt.element != element:
        raise ConversionError(f"{source}: {fqn}: the manifest says MX element {fmt.element}, its planes are {element}")
    return fmt.rule


def mx_params(reader: Any, source: str) -> dict[str, MXParam]:
    """Every MX parameter of the checkpoint open in ``reader``, by model key (``model.<fqn>``).

    A parameter is MX when the checkpoint holds ``mx.<fqn>.rowwise_data``; its element comes
    from that tensor's dtype, its rule from the plan's ``mx`` entry for it (else ``writer.mx``,
    else unknown). Checked, one line each: both rowwise planes present, the data in an FP8
    element dtype and shaped like ``model.<fqn>``, the scale E8M0 ``[M, K/32]``."""
    keys = set(reader.keys())
    fqns = sorted(
        {k[len("mx.") :].rsplit(".", 1)[0] for k in keys if k.startswith("mx.") and k.rsplit(".", 1)[-1] in MX_PLANES}
    )
    if not fqns:
        return {}
    per_param, fallback = _recorded_formats(reader.manifest, source)
    out: dict[str, MXParam] = {}
    for fqn in fqns:
        data, scale, weight = mx_key(fqn, "rowwise_data"), mx_key(fqn, "rowwise_scale"), f"model.{fqn}"
        missing = [k for k in (data, scale, weight) if k not in keys or not reader.is_tensor(k)]
        if missing:
            raise ConversionError(f"{source}: MX parameter {fqn} lacks {', '.join(missing)}")
        element = element_of_dtype(reader.dtype(data))
        if element is None:
            raise ConversionError(
                f"{source}: {data} is {reader.dtype(data)}, not an MX element dtype (float8_e4m3fn, float8_e5m2)"
            )
        shape = tuple(reader.shape(weight))
        if tuple(reader.shape(data)) != shape or len(shape) != 2 or shape[1] % BLOCK:
            raise ConversionError(
                f"{source}: {data} has shape {tuple(reader.shape(data))}; {weight} is {shape} "
                f"(MX needs the same [M, K] with K a multiple of {BLOCK})"
            )
        want = (shape[0], shape[1] // BLOCK)
        if reader.dtype(scale) != E8M0 or tuple(reader.shape(scale)) != want:
            raise ConversionError(
                f"{source}: {scale} is {reader.dtype(scale)} {tuple(reader.shape(scale))}, "
                f"expected float8_e8m0fnu {want}"
            )
        entry = per_param.get(fqn, fallback)
        rule = _recorded(entry, fqn, element, source) if entry is not None else None
        out[weight] = MXParam(fqn, element, rule)
    return out


def single_format(params: Mapping[str, MXParam], source: str) -> MXFormat:
    """The one format every MX parameter shares (an MX export records one); refuses unknown
    rules and mixed formats, naming them."""
    unknown = sorted(p.fqn for p in params.values() if p.rule is None)
    if unknown:
        raise ConversionError(
            f"{source}: the manifest records no MX scale rule for {unknown[0]}"
            f"{f' (and {len(unknown) - 1} more)' if len(unknown) > 1 else ''} "
            "(writer.plan.buffers[i].mx or writer.mx); an MX export must state it"
        )
    formats = sorted({(p.element, p.rule) for p in params.values()})
    if len(formats) > 1:
        raise ConversionError(
            f"{source}: MX parameters in several formats ({', '.join(f'{e} {r}' for e, r in formats)}); "
            "an MX export records one"
        )
    return MXFormat(*formats[0])


def scale_name(hf_weight: str) -> str:
    """``<module>.weight_scale_inv`` for the HF tensor ``<module>.weight``."""
    return f"{module_of(hf_weight)}.{SCALE_SUFFIX}"


def module_of(hf_weight: str) -> str:
    """``<module>`` of the HF tensor ``<module>.weight``; a ConversionError for other names."""
    if not hf_weight.endswith(".weight"):
        raise ConversionError(f"{hf_weight}: an MX weight's HF name must end in '.weight'")
    return hf_weight[: -len(".weight")]


def _probe(rows: int, cols: int) -> torch.Tensor:
    """``[rows, cols]`` int64 whose element (r, c) is ``r * cols + c``: where each element came
    from stays readable after a rule has moved it."""
    return torch.arange(rows * cols, dtype=torch.int64).reshape(rows, cols)


def check_rows_only(conv: Conversion, shape: torch.Size, cfg: ModelShape) -> None:
    """Refuse (naming the tensor) a conversion whose rule does anything to an ``[M, K]`` weight
    but select and reorder whole rows: only then do the rowwise scales, split the same way, still
    describe their 32-element blocks. Checked by running the rule's ``split`` on a probe of ``M``
    rows and 64 columns (two blocks per row) whose values record their origin, and by the shapes
    the rule declares for the real ``K``."""
    m, k = int(shape[0]), int(shape[1])
    for name, theirs in zip(conv.theirs, conv.rule.their_shapes(shape, cfg)):
        if len(theirs) != 2 or theirs[1] != k:
            raise ConversionError(
                f"{name}: cannot be exported as MX exactly: the mapping of {conv.ours} makes it "
                f"{tuple(theirs)} from {tuple(shape)} (only whole rows may be split)"
            )
    width = 2 * BLOCK
    for name, piece in zip(conv.theirs, conv.rule.split(_probe(m, width), cfg)):
        starts = piece[:, 0]
        whole_rows = (
            piece.shape[1] == width
            and bool((starts % width == 0).all())
            and bool((piece - starts[:, None] == torch.arange(width)).all())
        )
        if not whole_rows:
            raise ConversionError(
                f"{name}: cannot be exported as MX exactly: the mapping of {conv.ours} moves "
                "elements within rows, which breaks the 32-element scale blocks"
            )


def split_rows(conv: Conversion, tensor: torch.Tensor, cfg: ModelShape) -> list[torch.Tensor]:
    """``conv``'s split of a 1-byte tensor (FP8 data or E8M0 scales), done on its bytes (the rules
    reshape, index and concatenate, which not every kernel supports for these dtypes), each piece
    given back in ``tensor``'s dtype."""
    return [p.view(tensor.dtype) for p in conv.rule.split(tensor.view(torch.uint8), cfg)]


def quantization_config(fmt: MXFormat, quantized: list[str], not_quantized: list[str]) -> dict[str, Any]:
    """``config.json``'s ``quantization_config`` for an MX export: transformers' ``mxfp8`` fields
    (block ``[1, 32]``, E8M0 scales, dynamic activations, the modules left unquantized) and
    ``mfsdp_mx``: block size, element, scale rule, the scale tensors' suffix and the quantized
    modules (HF module names)."""
    return {
        "quant_method": QUANT_METHOD,
        "weight_block_size": [1, BLOCK],
        "scale_fmt": "ue8m0",
        "activation_scheme": "dynamic",
        "modules_to_not_convert": sorted(not_quantized),
        EXTENSION: {
            "block_size": BLOCK,
            "element": fmt.element,
            "rule": fmt.rule,
            "scale_suffix": SCALE_SUFFIX,
            "quantized_modules": sorted(quantized),
        },
    }


def _field(d: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in d:
        raise ConversionError(f"{where}: no '{key}'")
    return d[key]


def parse_quantization_config(qc: Any, config_path: str) -> tuple[MXFormat, set[str]]:
    """The MX format and the quantized HF modules of a ``quantization_config`` written by an MX
    export; one ConversionError line naming ``config.json`` and the field otherwise: another
    ``quant_method``, another block or scale format, no ``mfsdp_mx`` (a checkpoint quantized
    elsewhere states no scale rule), an unknown element or rule, a malformed module list."""
    where = f"{config_path}: quantization_config"
    if not isinstance(qc, dict):
        raise ConversionError(f"{where} must be an object, got {short_repr(qc)}")
    method = _field(qc, "quant_method", where)
    if method != QUANT_METHOD:
        raise ConversionError(f"{where}.quant_method {short_repr(method)} is not supported (only {QUANT_METHOD!r})")
    block = qc.get("weight_block_size", [1, BLOCK])
    if block != [1, BLOCK]:
        raise ConversionError(f"{where}.weight_block_size {short_repr(block)}: MX blocks are [1, {BLOCK}]")
    scale_fmt = qc.get("scale_fmt", "ue8m0")
    if scale_fmt != "ue8m0":
        raise ConversionError(f"{where}.scale_fmt {short_repr(scale_fmt)}: MX scales are 'ue8m0'")
    ext = _field(qc, EXTENSION, where)
    if not isinstance(ext, dict):
        raise ConversionError(f"{where}.{EXTENSION} must be an object, got {short_repr(ext)}")
    sub = f"{where}.{EXTENSION}"
    if _field(ext, "block_size", sub) != BLOCK or type(ext["block_size"]) is not int:
        raise ConversionError(f"{sub}.block_size {short_repr(ext['block_size'])}: MX blocks are {BLOCK} elements")
    element, rule = _field(ext, "element", sub), _field(ext, "rule", sub)
    if element not in ELEMENTS:
        raise ConversionError(
            f"{sub}.element: unknown MX element {short_repr(element)} (expected {', '.join(ELEMENTS)})"
        )
    if rule not in RULES:
        raise ConversionError(f"{sub}.rule: unknown MX scale rule {short_repr(rule)} (expected {', '.join(RULES)})")
    suffix = ext.get("scale_suffix", SCALE_SUFFIX)
    if suffix != SCALE_SUFFIX:
        raise ConversionError(f"{sub}.scale_suffix {short_repr(suffix)}: expected {SCALE_SUFFIX!r}")
    modules = _field(ext, "quantized_modules", sub)
    if not isinstance(modules, list) or not all(isinstance(m, str) and m.isprintable() for m in modules):
        raise ConversionError(f"{sub}.quantized_modules must be a list of module names, got {short_repr(modules)}")
    if len(set(modules)) != len(modules):
        raise ConversionError(f"{sub}.quantized_modules names a module twice")
    return MXFormat(element, rule), set(modules)


def mx_plan(cfg: ModelShape, model: ShapeModel, formats: Mapping[str, MXFormat]) -> ModelPlan:
    """The placement plan an import records: the default one (see ``model.shape.default_plan``),
    except that the parameters in ``formats`` (by fqn) are MX: ``block(32)`` with their format,
    as ``cli.train --mxfp8`` places them, so that the manifest's ``writer.plan.buffers[i].mx``
    says which parameters are MX and how."""
    place = mx_marked(placement_fn(None, None), {id(model.get_parameter(fqn)): fmt for fqn, fmt in formats.items()})
    return plan_model(model, sharding_units(model), placement=place)


def fqn_of(model_key: str) -> str:
    """``<fqn>`` of ``model.<fqn>`` (for MX key names)."""
    fqn = fqn_of_model_key(model_key)
    if fqn is None:
        raise ConversionError(f"{model_key}: not a model key")
    return fqn
