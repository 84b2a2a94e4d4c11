"""``import-hf`` of block-scaled FP8 directories (DeepSeek-V3's format: F8_E4M3 weights, each
with a ``weight_scale_inv`` per ``weight_block_size`` block), ``--dtype`` on any directory, and
what an FP8 import refuses.

The FP8 copy of a tiny Llama is made here, by the format's definition (scale = block amax / 448,
data = weight / scale in E4M3), with 16 x 16 blocks over dimensions that are not multiples of 16,
so every weight has partial edge blocks; the expected values are computed here too, from the
formula ``fp8.float() * scale_inv[r // bo, c // bi]``, independently of ``mfsdp_ckpt.hf.fp8``."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

pytest.importorskip("transformers")

from cli.main import main
from mfsdp_ckpt import hf
from mfsdp_ckpt.errors import ConversionError
from mfsdp_ckpt.hf import fp8
from mfsdp_ckpt.hf.files import INDEX_NAME
from mfsdp_ckpt.hf.mapping import FusedQKV, expand
from mfsdp_ckpt.hf.workers import Staging
from mfsdp_ckpt.model.shape import recorded_shape
from mfsdp_ckpt.read.reader import CheckpointReader

from .util import hf_config, hf_tensors, random_hf_model, save_hf

BLOCK = (16, 16)
#: hidden 40, heads of 10, 2 KV heads (k/v: 20 rows), FFN 56: no dimension a multiple of 16
SHAPE = dict(hidden_size=40, intermediate_size=56, num_attention_heads=4, num_key_value_heads=2)
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
Q = "model.layers.1.self_attn.q_proj"


def is_linear(key: str) -> bool:
    return key.startswith("model.layers.") and key.endswith(".weight") and key.split(".")[-2] in LINEAR


def expand_blocks(scale: torch.Tensor, shape: torch.Size, block: tuple[int, int]) -> torch.Tensor:
    """``scale`` [ceil(out/bo), ceil(in/bi)] as float32 [out, in]: element (r, c) is
    ``scale[r // bo, c // bi]``."""
    bo, bi = block
    return scale.float().repeat_interleave(bo, 0).repeat_interleave(bi, 1)[: shape[0], : shape[1]]


def quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` as E4M3 data and float32 ``scale_inv`` per block: scale = block amax / 448."""
    bo, bi = block
    rows, cols = w.shape
    nr, nc = -(-rows // bo), -(-cols // bi)
    padded = torch.zeros(nr * bo, nc * bi)
    padded[:rows, :cols] = w.float().abs()
    amax = padded.view(nr, bo, nc, bi).amax(dim=(1, 3))
    scale = (amax / 448.0).clamp_min(1e-12)
    data = (w.float() / expand_blocks(scale, w.shape, block)).to(torch.float8_e4m3fn)
    return data, scale


def dequantized(data: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The formula, in float32."""
    return data.float() * expand_blocks(scale, data.shape, block)


def write_dir(path, tensors: dict[str, torch.Tensor], config: dict, files: list[list[str]] | None = None) -> None:
    """An HF directory: ``config.json`` and the tensors in one ``model.safetensors``, or in one
    file per list of keys in ``files`` with an index."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    if files is None:
        save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, keys in enumerate(files):
        name = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        save_file({k: tensors[k] for k in keys}, os.path.join(path, name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, name))
    with open(os.path.join(path, INDEX_NAME), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


def fp8_copy(
    src: str, dst, block=BLOCK, scale_dtype=torch.float32, files: int = 1, quantized=is_linear
) -> dict[str, torch.Tensor]:
    """An FP8 block-scaled copy of the HF directory ``src`` at ``dst`` (every decoder linear
    weight, or every key ``quantized`` says, quantized; the rest as it was;
    ``quantization_config`` as DeepSeek-V3 writes it);
    ``files=2`` splits it over two files by layer, one weight's scale in the other file than the
    weight. Returns every tensor written, by key."""
    tensors = {}
    for key, t in hf_tensors(src).items():
        if quantized(key):
            data, scale = quantize_blocks(t, block)
            tensors[key] = data
            tensors[fp8.scale_name(key)] = scale.to(scale_dtype)
        else:
            tensors[key] = t
    config = read_config(src)
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
        "modules_to_not_convert": ["lm_head"],
    }
    layout = None
    if files == 2:
        second = [k for k in tensors if k.startswith("model.layers.1.") and k != f"{Q}.weight_scale_inv"]
        layout = [[k for k in tensors if k not in second], second]  # Q's scale in file 1, its weight in file 2
    write_dir(dst, tensors, config, layout)
    return tensors


def read_config(path) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def shape_of(checkpoint: str):
    with CheckpointReader(checkpoint) as reader:
        return recorded_shape(reader.manifest, checkpoint, "the test")


def canonical_to_hf(checkpoint: str) -> dict[str, torch.Tensor]:
    """Every model tensor of ``checkpoint``, split back into its HF tensors by the mapping."""
    with CheckpointReader(checkpoint) as reader:
        manifest = reader.manifest
        cfg = recorded_shape(manifest, checkpoint, "the test")
        out = {}
        for conv in expand(hf.get_architecture(manifest["hf"]["architecture"]), cfg):
            out.update(zip(conv.theirs, (p.clone() for p in conv.rule.split(reader.read(conv.ours), cfg))))
    return out


def expected(
    tensors: dict[str, torch.Tensor], block, dtype: torch.dtype, cast_all: bool = True
) -> dict[str, torch.Tensor]:
    """What an import writing ``dtype`` must give, per HF weight: the formula's value for FP8
    weights, the source for the rest, cast to ``dtype`` (``cast_all=False``: the rest as it is)."""
    out = {}
    for key, t in tensors.items():
        if key.endswith(".weight_scale_inv"):
            continue
        if t.dtype == torch.float8_e4m3fn:
            out[key] = dequantized(t, tensors[fp8.scale_name(key)], block).to(dtype)
        else:
            out[key] = t.to(dtype) if cast_all else t
    return out


def assert_bitwise(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for key in want:
        assert got[key].dtype == want[key].dtype, (key, got[key].dtype, want[key].dtype)
        assert torch.equal(got[key], want[key]), key


def cli(*args: str):
    return CliRunner().invoke(main, list(args))


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> str:
    """A tiny Llama in bf16 (DeepSeek's unquantized dtype), saved by transformers."""
    model = random_hf_model(hf_config("llama", **SHAPE), dtype=torch.bfloat16)
    return save_hf(model, str(tmp_path_factory.mktemp("src") / "llama"))


@pytest.fixture(scope="module")
def fp8_dir(source, tmp_path_factory):
    path = tmp_path_factory.mktemp("fp8") / "llama-fp8"
    return str(path), fp8_copy(source, path)


# ------------------------------------------------------------------------------------------------
# dequantization


@pytest.mark.parametrize(
    "shape,block,band_rows",
    [((37, 50), (16, 16), 3), ((37, 50), (16, 16), 40), ((5, 300), (1, 128), 2), ((20, 7), (128, 128), 6)],
)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_dequantize_blocks_is_the_formula_bitwise(shape, block, band_rows, out_dtype, scale_dtype, monkeypatch):
    """Bands that start and end inside blocks, blocks larger than the weight, one-row blocks."""
    monkeypatch.setattr(fp8, "BAND_BYTES", band_rows * shape[1] * 4)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-8, 9, (shape[0], 1), generator=g).float())
    data, scale = quantize_blocks(w, block)
    scale = scale.to(scale_dtype)
    out = fp8.dequantize_blocks(data, scale, block, torch.empty(shape, dtype=out_dtype), Staging())
    assert torch.equal(out, dequantized(data, scale, block).to(out_dtype))


def test_dequantize_blocks_holds_one_band_not_a_float32_copy(monkeypatch):
    """The float32 work buffer is one band (here 16 rows), however tall the weight."""
    monkeypatch.setattr(fp8, "BAND_BYTES", 16 * 64 * 4)
    data, scale = quantize_blocks(torch.randn(300, 64), BLOCK)
    scratch = Staging()
    out = fp8.dequantize_blocks(data, scale, BLOCK, torch.empty(300, 64, dtype=torch.bfloat16), scratch)
    assert scratch._buf.numel() == 16 * 64 * 4
    assert torch.equal(out, dequantized(data, scale, BLOCK).to(torch.bfloat16))


# ------------------------------------------------------------------------------------------------
# imports


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_import_is_the_formula_bitwise_and_verifies(fp8_dir, dtype, tmp_path):
    src, tensors = fp8_dir
    name = str(dtype).split(".")[-1]
    ckpt = str(tmp_path / "ckpt")
    result = cli("import-hf", src, ckpt, "--dtype", name, "--json")
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    assert info["quantization"] == "fp8" and info["dtypes"] == {name: info["tensors"]}
    assert_bitwise(canonical_to_hf(ckpt), expected(tensors, BLOCK, dtype))
    with CheckpointReader(ckpt) as reader:
        record = reader.manifest["hf"]
    assert record["architecture"] == "llama" and record["dtypes"] == {name: info["tensors"]}
    assert record["quantization"] == {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "weight_block_size": list(BLOCK),
        "weights": 2 * len(LINEAR),
        "dequantized_to": name,
    }
    assert cli("verify", ckpt).exit_code == 0


def test_default_dtype_is_the_unquantized_tensors_dtype(fp8_dir, tmp_path):
    """Without --dtype, FP8 weights become bfloat16 here (the unquantized tensors' dtype); the
    text output says so."""
    src, tensors = fp8_dir
    result = cli("import-hf", src, str(tmp_path / "ckpt"))
    assert result.exit_code == 0, result.output
    assert (
        f"{len(expand(hf.get_architecture('llama'), shape_of(str(tmp_path / 'ckpt'))))} tensors (bfloat16; dequantized from fp8)"
        in result.stdout
    )
    assert_bitwise(canonical_to_hf(str(tmp_path / "ckpt")), expected(tensors, BLOCK, torch.bfloat16))


def test_default_dtype_follows_most_unquantized_bytes(source, tmp_path):
    """float32 unquantized tensors: FP8 weights are dequantized to float32, nothing is cast."""
    src32 = tmp_path / "src32"
    write_dir(src32, {k: v.float() for k, v in hf_tensors(source).items()}, read_config(source))
    tensors = fp8_copy(str(src32), tmp_path / "fp8")
    result = hf.import_(tmp_path / "fp8", tmp_path / "ckpt")
    assert result.dtypes == {"float32": result.tensors}
    assert_bitwise(canonical_to_hf(str(tmp_path / "ckpt")), expected(tensors, BLOCK, torch.float32))


def test_deepseek_v3_as_released(tmp_path):
    """DeepSeek-V3's own layout: bf16 tensors with float32 router biases
    (``e_score_correction_bias``), FP8 attention (MLA: q_a/q_b/kv_a/kv_b/o), dense, shared and
    routed expert projections, an MTP layer with its replicated embedding and head. Without
    --dtype the FP8 weights become bfloat16 (most unquantized bytes) and the biases stay
    float32; with --dtype float32 everything is the formula's float32 value or the source's."""
    from .test_deepseek_v3 import deepseek_dir

    src, _, _ = deepseek_dir(str(tmp_path / "src"))
    released = {
        k: v if k.endswith("e_score_correction_bias") else v.to(torch.bfloat16) for k, v in hf_tensors(src).items()
    }
    write_dir(tmp_path / "bf16", released, read_config(src))

    def projection(key: str) -> bool:
        return key.startswith("model.layers.") and key.endswith(("_proj.weight", "_proj_with_mqa.weight"))

    tensors = fp8_copy(str(tmp_path / "bf16"), tmp_path / "fp8", quantized=projection)
    assert {k.split(".")[-2] for k, v in tensors.items() if v.dtype == torch.float8_e4m3fn} >= {
        "q_a_proj",
        "q_b_proj",
        "kv_a_proj_with_mqa",
        "kv_b_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
        "eh_proj",
    }
    biases = sum(k.endswith("e_score_correction_bias") for k in tensors)
    result = hf.import_(tmp_path / "fp8", tmp_path / "ckpt")
    assert result.architecture == "deepseek_v3" and result.quantization == "fp8"
    assert result.dtypes == {"bfloat16": result.tensors - biases, "float32": biases}
    assert_bitwise(canonical_to_hf(str(tmp_path / "ckpt")), expected(tensors, BLOCK, torch.bfloat16, cast_all=False))
    hf.import_(tmp_path / "fp8", tmp_path / "ckpt32", dtype="float32")
    assert_bitwise(canonical_to_hf(str(tmp_path / "ckpt32")), expected(tensors, BLOCK, torch.float32))


def test_fp8_split_over_two_files_bf16_scales_two_workers(source, tmp_path):
    tensors = fp8_copy(source, tmp_path / "fp8", block=(16, 32), scale_dtype=torch.bfloat16, files=2)
    with open(tmp_path / "fp8" / INDEX_NAME) as f:
        weight_map = json.load(f)["weight_map"]
    assert len(set(weight_map.values())) == 2
    assert weight_map[f"{Q}.weight"] != weight_map[f"{Q}.weight_scale_inv"]
    assert any(weight_map[k].startswith("model-00001") for k in tensors if tensors[k].dtype == torch.float8_e4m3fn)
    assert any(weight_map[k].startswith("model-00002") for k in tensors if tensors[k].dtype == torch.float8_e4m3fn)
    result = hf.import_(tmp_path / "fp8", tmp_path / "ckpt", dtype="float32", workers=2)
    assert result.quantization == "fp8"
    assert_bitwise(canonical_to_hf(str(tmp_path / "ckpt")), expected(tensors, (16, 32), torch.float32))
    assert cli("verify", str(tmp_path / "ckpt")).exit_code == 0


def test_rules_without_views_merge_dequantized_copies(fp8_dir, monkeypatch, tmp_path):
    """A rule that cannot give views into the canonical tensor (here the fused QKV, made to
    decline) merges dequantized copies instead: the same values."""
    monkeypatch.setattr(FusedQKV, "views", lambda self, tensor, c: None)
    src, tensors = fp8_dir
    hf.import_(src, tmp_path / "ckpt", dtype="bfloat16", workers=1)
    monkeypatch.undo()  # the check splits with the views
    assert_bitwise(canonical_to_hf(str(tmp_path / "ckpt")), expected(tensors, BLOCK, torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dtype_casts_a_directory_without_fp8(source, dtype, tmp_path):
    name = str(dtype).split(".")[-1]
    result = hf.import_(source, tmp_path / "ckpt", dtype=name)
    assert result.quantization == "none" and result.dtypes == {name: result.tensors}
    want = {k: v.to(dtype) for k, v in hf_tensors(source).items()}
    assert_bitwise(canonical_to_hf(str(tmp_path / "ckpt")), want)


def test_without_dtype_a_plain_import_keeps_the_hf_dtypes(source, tmp_path):
    result = hf.import_(source, tmp_path / "ckpt")
    assert result.quantization == "none" and result.dtypes == {"bfloat16": result.tensors}
    with CheckpointReader(str(tmp_path / "ckpt")) as reader:
        assert "quantization" not in reader.manifest["hf"]
    assert_bitwise(canonical_to_hf(str(tmp_path / "ckpt")), hf_tensors(source))


@pytest.mark.parametrize("dtype", ["float16", "int8", torch.float64, 3])
def test_dtype_outside_the_choices_is_refused(source, dtype, tmp_path):
    with pytest.raises(ConversionError, match="expected one of bfloat16, float32"):
        hf.import_(source, tmp_path / "ckpt", dtype=dtype)
    assert os.listdir(tmp_path) == []
    result = cli("import-hf", source, str(tmp_path / "ckpt"), "--dtype", "float16")
    assert result.exit_code == 2 and "float16" in result.stderr


# ------------------------------------------------------------------------------------------------
# refusals: one line on stderr naming the file and the tensor (or config.json and the field),
# exit 1, nothing at the destination


def _qc(edit):
    def apply(tensors, config):
        edit(config["quantization_config"])

    return apply


def _set(key, value):
    return _qc(lambda qc: qc.__setitem__(key, value))


def _tensor(key, fn):
    def apply(tensors, config):
        tensors[key] = fn(tensors[key])

    return apply


SCALE = f"{Q}.weight_scale_inv"
FILE = "model.safetensors"
CONFIG = "config.json: quantization_config"
BAD = {
    "scale shape": (
        _tensor(SCALE, lambda s: s[:, :2].contiguous()),
        f"{FILE}: tensor '{SCALE}' has shape (3, 2), expected (3, 3) (one scale per [16, 16] block of '{Q}.weight' (40, 40)",
    ),
    "scale rows": (
        _tensor(SCALE, lambda s: torch.cat([s, s[:1]])),
        f"{FILE}: tensor '{SCALE}' has shape (4, 3), expected (3, 3)",
    ),
    "missing scale": (
        lambda t, c: t.pop(SCALE),
        f"{FILE}: FP8 tensor '{Q}.weight' has no '{SCALE}' (its block scales)",
    ),
    "no quantization_config": (
        lambda t, c: c.pop("quantization_config"),
        f"{FILE}: tensor 'model.layers.0.mlp.down_proj.weight' is F8_E4M3, but config.json has no quantization_config",
    ),
    "another method": (_set("quant_method", "gptq"), f"{CONFIG}.quant_method 'gptq' is not supported"),
    "an mxfp8 config that does not list it": (
        lambda t, c: c.__setitem__(
            "quantization_config",
            {
                "quant_method": "mxfp8",
                "weight_block_size": [1, 32],
                "scale_fmt": "ue8m0",
                "mfsdp_mx": {"block_size": 32, "element": "e4m3", "rule": "floor", "quantized_modules": []},
            },
        ),
        f"{FILE}: tensor 'model.layers.0.mlp.down_proj.weight' is F8_E4M3, but quantization_config "
        "(quant_method 'mxfp8') does not quantize it",
    ),
    "block of one number": (
        _set("weight_block_size", [16]),
        f"{CONFIG}.weight_block_size [16]: expected [rows, columns]",
    ),
    "block of zero": (_set("weight_block_size", [0, 16]), f"{CONFIG}.weight_block_size [0, 16]: expected"),
    "block of floats": (_set("weight_block_size", [16.0, 16]), f"{CONFIG}.weight_block_size [16.0, 16]: expected"),
    "block of strings": (_set("weight_block_size", "128"), f"{CONFIG}.weight_block_size '128': expected"),
    "block of booleans": (_set("weight_block_size", [True, 16]), f"{CONFIG}.weight_block_size [True, 16]: expected"),
    "block null": (_set("weight_block_size", None), f"{CONFIG}.weight_block_size is null (per-tensor scales)"),
    "other block than the scales": (
        _set("weight_block_size", [8, 16]),
        "tensor 'model.layers.0.mlp.down_proj.weight_scale_inv' has shape (3, 4), expected (5, 4)",
    ),
    "fmt": (_set("fmt", "e5m2"), f"{CONFIG}.fmt 'e5m2' is not supported"),
    "fmt not a string": (_set("fmt", ["e4m3"]), f"{CONFIG}.fmt ['e4m3'] is not supported"),
    "config not an object": (
        lambda t, c: c.__setitem__("quantization_config", ["fp8"]),
        "config.json: quantization_config must be an object",
    ),
    "static activations": (
        _set("activation_scheme", "static"),
        f"{CONFIG}.activation_scheme 'static' is not supported",
    ),
    "fp4 experts": (_set("expert_dtype", "fp4"), f"{CONFIG}.expert_dtype 'fp4' is not supported"),
    "weight not e4m3": (
        _tensor(f"{Q}.weight", lambda w: w.float().to(torch.float8_e5m2)),
        f"{FILE}: tensor '{Q}.weight' is F8_E5M2; quantization_config.fmt is 'e4m3' (F8_E4M3)",
    ),
    "scale in e8m0": (
        _tensor(SCALE, lambda s: s.to(torch.float8_e8m0fnu)),
        f"{CONFIG}.quant_method 'fp8' is not supported with E8M0 scales (",
    ),
    "scale in u8": (
        _tensor(SCALE, lambda s: s.to(torch.uint8)),
        f"{FILE}: tensor '{SCALE}' is U8, expected F32, BF16 or F16 (block scales)",
    ),
    "fp8 norm": (
        _tensor("model.norm.weight", lambda w: w.float().to(torch.float8_e4m3fn)),
        f"{FILE}: tensor 'model.norm.weight' (40,) is FP8 but not a '<module>.weight' matrix",
    ),
    "scale next to an unquantized weight": (
        lambda t, c: t.__setitem__("lm_head.weight_scale_inv", torch.ones(6, 3)),
        "unexpected tensors (no mapping in llama): lm_head.weight_scale_inv",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_fp8_directories_are_refused_in_one_line(case, fp8_dir, tmp_path):
    edit, message = BAD[case]
    src_dir, tensors = fp8_dir
    config = read_config(src_dir)
    tensors = dict(tensors)
    edit(tensors, config)
    src = tmp_path / "src"
    write_dir(src, tensors, config)
    dest = tmp_path / "out" / "ckpt"
    dest.parent.mkdir()
    result = cli("import-hf", str(src), str(dest), "--dtype", "float32")
    assert result.exit_code == 1, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert message in lines[0], lines[0]
    if message.startswith(FILE):
        assert str(src / FILE) in lines[0]
    assert os.listdir(dest.parent) == []  # no checkpoint, no partial sibling


@pytest.mark.heavy  # slow (the inner loop's 8 minutes); CI runs it
def test_an_mx_directory_is_imported_in_float32_only(tmp_path):
    """MX weights stay float32 (their planes are derived from them): --dtype bfloat16 is refused
    for an MX directory, --dtype float32 is what it does anyway."""
    from .test_mx_hf import mx_checkpoint

    ckpt = mx_checkpoint(str(tmp_path / "mx"))
    hf.export(ckpt, tmp_path / "hf", mode="mx")
    with pytest.raises(ConversionError, match="imported in float32 .* give float32 or no dtype"):
        hf.import_(tmp_path / "hf", tmp_path / "bf16", dtype="bfloat16")
    assert not (tmp_path / "bf16").exists()
    result = hf.import_(tmp_path / "hf", tmp_path / "f32", dtype="float32")
    assert result.quantization == "mxfp8" and set(result.dtypes) == {"float32"}
    shutil.rmtree(tmp_path / "f32")
