"""MXFP8 checkpoints through the HF bridge: ``export-hf`` of the weights (fp32 main params cast),
``--from-mx`` (the dequantized rowwise planes), ``--mx`` (the rowwise planes raw, transformers'
``mxfp8`` convention), ``import-hf`` of an MX directory back into an MX checkpoint, round trips,
and what both directions refuse."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import save_file

from cli.main import main
from mfsdp_ckpt import hf
from mfsdp_ckpt.errors import ConversionError
from mfsdp_ckpt.format.manifest import writer_layout
from mfsdp_ckpt.hf.files import INDEX_NAME
from mfsdp_ckpt.hf.mapping import Conversion, Direct, Rule, canonical_shapes, expand
from mfsdp_ckpt.hf.mx import check_rows_only, split_rows
from mfsdp_ckpt.read.reader import CheckpointReader
from mfsdp_ckpt.write.builder import CheckpointBuilder
from mfsdp_core.mixed_precision import MixedPrecision
from mfsdp_core.models.gpt import (
    PRESETS,
    GPTConfig,
    GPTModel,
    linear_weights,
    shard_units,
)
from mfsdp_core.mx import MXFormat, dequantize, quantize
from mfsdp_core.plan import mx_marked, placement_fn, plan_model

DEFAULT_FORMAT = MXFormat()

PLANES = {"row": ("rowwise_data", "rowwise_scale"), "col": ("columnwise_data", "columnwise_scale")}


# the native cast and the reference give the same bytes; the fallback notice is noise here
pytestmark = pytest.mark.filterwarnings("ignore::mfsdp_core.mx.MXNativeUnavailableWarning")


def mx_checkpoint(
    path: str,
    preset: str = "tiny",
    fmt: MXFormat = DEFAULT_FORMAT,
    *,
    bf16: bool = True,
    record_rule: bool = True,
    seed: int = 0,
) -> str:
    """A checkpoint as MXFP8 training writes it: the transformer layers' linear weights MX
    (``cli.train --mxfp8`` placement, recorded in ``writer.plan``), ``model.*`` in bf16 with fp32
    ``optim.*.main_param`` (or fp32 ``model.*`` when not ``bf16``), and the four MX planes of each
    MX weight quantized from its fp32 main params. Weights get row magnitudes spread over 2^±10,
    so that the scales differ from block to block."""
    torch.manual_seed(seed)
    cfg = PRESETS[preset]
    model = GPTModel(cfg)
    mx_weights = linear_weights(model)
    plan = plan_model(
        model,
        shard_units(model),
        placement=mx_marked(placement_fn(None, None), dict.fromkeys(map(id, mx_weights), fmt)),
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16 if bf16 else None),
    )
    writer = writer_layout(1, plan)
    if not record_rule:
        for buf in writer["plan"]["buffers"]:
            buf.pop("mx", None)
    manifest = {
        "writer": writer,
        "model_config": cfg.to_dict(),
        "step": 7,
        "include_grads": False,
        "has_optimizer": False,
        "versions": {},
    }
    ids = {id(p) for p in mx_weights}
    with CheckpointBuilder(path, manifest) as b:
        for name, p in model.named_parameters():
            main_param = p.detach().float()
            if p.dim() == 2:
                main_param = main_param * torch.exp2(torch.randint(-10, 11, (p.shape[0], 1)).float())
            b.add_tensor(f"model.{name}", main_param.to(torch.bfloat16) if bf16 else main_param)
            if bf16:
                b.add_tensor(f"optim.{name}.main_param", main_param)
            if id(p) in ids:
                for axis, (data_plane, scale_plane) in PLANES.items():
                    data, scale = quantize(main_param, fmt, axis)
                    b.add_tensor(f"mx.{name}.{data_plane}", data)
                    b.add_tensor(f"mx.{name}.{scale_plane}", scale)
        b.commit()
    return path


def read_ckpt(path: str) -> tuple[dict[str, torch.Tensor], dict]:
    with CheckpointReader(path) as r:
        return {k: r.read(k) for k in r.keys() if r.is_tensor(k)}, r.manifest


def read_hf(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of an HF directory, through ``safe_open`` (``safetensors.torch.load`` does not
    know F8_E8M0)."""
    out = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(path, name), framework="pt") as f:
                out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def header_dtypes(path: str) -> dict[str, str]:
    """Tensor name -> the dtype string in the safetensors headers (read raw)."""
    out = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            with open(os.path.join(path, name), "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(n))
            out.update({k: v["dtype"] for k, v in header.items() if k != "__metadata__"})
    return out


def conversions(manifest: dict) -> list[Conversion]:
    cfg = GPTConfig.from_dict(manifest["model_config"])
    arch = hf.get_architecture("mixtral" if cfg.num_experts else "llama")
    return cfg, expand(arch, cfg)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return mx_checkpoint(str(tmp_path_factory.mktemp("mx") / "ckpt"))


# ------------------------------------------------------------------------------------------------
# export


@pytest.mark.heavy
def test_bf16_export_is_the_main_params_cast(ckpt, tmp_path):
    hf.export(ckpt, tmp_path / "out", dtype="bfloat16")
    state, manifest = read_ckpt(ckpt)
    got = read_hf(str(tmp_path / "out"))
    cfg, convs = conversions(manifest)
    assert len(got) == sum(len(c.theirs) for c in convs)
    for conv in convs:
        main_param = state[f"optim.{conv.ours[len('model.') :]}.main_param"]
        for name, piece in zip(conv.theirs, conv.rule.split(main_param, cfg)):
            assert same_bytes(got[name], piece.to(torch.bfloat16)), name


@pytest.mark.heavy
def test_from_mx_export_is_the_dequantized_rowwise_planes(ckpt, tmp_path):
    hf.export(ckpt, tmp_path / "out", dtype="bfloat16", mode="from-mx")
    state, manifest = read_ckpt(ckpt)
    got = read_hf(str(tmp_path / "out"))
    cfg, convs = conversions(manifest)
    n_mx = 0
    for conv in convs:
        fqn = conv.ours[len("model.") :]
        if f"mx.{fqn}.rowwise_data" in state:
            n_mx += 1
            source = dequantize(state[f"mx.{fqn}.rowwise_data"], state[f"mx.{fqn}.rowwise_scale"], "row")
            assert not torch.equal(source, state[f"optim.{fqn}.main_param"])  # the planes, not the main params
        else:
            source = state[f"optim.{fqn}.main_param"]
        for name, piece in zip(conv.theirs, conv.rule.split(source, cfg)):
            assert same_bytes(got[name], piece.to(torch.bfloat16)), name
    assert n_mx == 2 * 4  # qkv, proj, fc1, fc2 in each of 2 layers


@pytest.mark.heavy  # slow (the inner loop's 8 minutes); CI runs it
@pytest.mark.parametrize(
    "preset,fmt,header",
    [("tiny", MXFormat("e4m3", "floor"), "F8_E4M3"), ("mixtral-like-small", MXFormat("e5m2", "rceil"), "F8_E5M2")],
)
def test_mx_export_writes_the_rowwise_planes_byte_for_byte(preset, fmt, header, tmp_path):
    ckpt = mx_checkpoint(str(tmp_path / "ckpt"), preset, fmt)
    hf.export(ckpt, tmp_path / "out", mode="mx", max_shard_size="200KB")
    state, manifest = read_ckpt(ckpt)
    got = read_hf(str(tmp_path / "out"))
    dtypes = header_dtypes(str(tmp_path / "out"))
    cfg, convs = conversions(manifest)
    quantized = []
    for conv in convs:
        fqn = conv.ours[len("model.") :]
        if f"mx.{fqn}.rowwise_data" not in state:
            for name, piece in zip(conv.theirs, conv.rule.split(state[conv.ours], cfg)):
                assert same_bytes(got[name], piece), name  # as the checkpoint has it (bf16)
                assert dtypes[name] == "BF16"
            continue
        data = split_rows(conv, state[f"mx.{fqn}.rowwise_data"], cfg)
        scale = split_rows(conv, state[f"mx.{fqn}.rowwise_scale"], cfg)
        for name, d, s in zip(conv.theirs, data, scale):
            scale_name = name[: -len("weight")] + "weight_scale_inv"
            assert same_bytes(got[name], d) and same_bytes(got[scale_name], s), name
            assert got[scale_name].shape == (d.shape[0], d.shape[1] // 32)
            assert dtypes[name] == header and dtypes[scale_name] == "F8_E8M0"
            quantized.append(name[: -len(".weight")])
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    qc = config["quantization_config"]
    assert qc["quant_method"] == "mxfp8" and qc["weight_block_size"] == [1, 32] and qc["scale_fmt"] == "ue8m0"
    assert qc["mfsdp_mx"] == {
        "block_size": 32,
        "element": fmt.element,
        "rule": fmt.rule,
        "scale_suffix": "weight_scale_inv",
        "quantized_modules": sorted(quantized),
    }
    assert "lm_head" in qc["modules_to_not_convert"] and "model.embed_tokens" in qc["modules_to_not_convert"]
    if cfg.num_experts:  # routers stay unquantized
        assert "model.layers.0.block_sparse_moe.gate" in qc["modules_to_not_convert"]
    assert config["torch_dtype"] == "bfloat16"
    index = json.loads((tmp_path / "out" / INDEX_NAME).read_text())
    assert set(index["weight_map"]) == set(got)


def test_mx_export_needs_planes_and_a_rule(tmp_path):
    plain = mx_checkpoint(str(tmp_path / "plain"), record_rule=False)
    with pytest.raises(ConversionError, match="records no MX scale rule for decoder.layers.0"):
        hf.export(plain, tmp_path / "out", mode="mx")
    assert not (tmp_path / "out").exists()
    hf.export(plain, tmp_path / "out2", mode="from-mx")  # dequantizing needs no rule
    cfg = PRESETS["tiny"]
    manifest = {
        "writer": {"world_size": 1, "buffers": [], "groups": []},
        "model_config": cfg.to_dict(),
        "step": None,
        "include_grads": False,
        "has_optimizer": False,
        "versions": {},
    }
    with CheckpointBuilder(str(tmp_path / "nomx"), manifest) as b:
        for k, v in GPTModel(cfg).named_parameters():
            b.add_tensor(f"model.{k}", v.detach())
        b.commit()
    for mode in ("mx", "from-mx"):
        with pytest.raises(ConversionError, match=f"--{mode} needs MX planes"):
            hf.export(str(tmp_path / "nomx"), tmp_path / "out3", mode=mode)


class _ColumnSplit(Rule):
    """A rule that halves the columns: MX rowwise blocks cannot follow it."""

    def their_shapes(self, shape, c):
        return [torch.Size((shape[0], shape[1] // 2))] * 2

    def split(self, tensor, c):
        return [t.contiguous() for t in tensor.chunk(2, dim=1)]


class _ColumnShuffle(Rule):
    """A rule that keeps shapes but reverses every row: blocks change their elements."""

    def their_shapes(self, shape, c):
        return [torch.Size(shape)]

    def split(self, tensor, c):
        return [tensor.flip(1).contiguous()]


def test_rules_that_move_columns_are_refused_naming_the_tensor():
    cfg = PRESETS["tiny"]
    shape = torch.Size((64, 128))
    check_rows_only(Conversion(Direct("x", "a.weight"), "model.x", ("a.weight",)), shape, cfg)
    with pytest.raises(ConversionError, match=r"^a\.weight: cannot be exported as MX exactly"):
        check_rows_only(
            Conversion(_ColumnSplit("x", ("a.weight", "b.weight")), "model.x", ("a.weight", "b.weight")), shape, cfg
        )
    with pytest.raises(
        ConversionError, match=r"^a\.weight: cannot be exported as MX exactly.*moves elements within rows"
    ):
        check_rows_only(Conversion(_ColumnShuffle("x", "a.weight"), "model.x", ("a.weight",)), shape, cfg)


def test_every_builtin_mapping_moves_whole_rows_only():
    for preset in ("tiny", "llama-like-small", "qwen3-like-small", "mixtral-like-small"):
        cfg = PRESETS[preset]
        shapes = canonical_shapes(cfg)
        for arch in hf.architectures().values():
            if arch.unsupported(cfg):
                continue
            for conv in expand(arch, cfg):
                if len(shapes[conv.ours]) == 2:
                    check_rows_only(conv, shapes[conv.ours], cfg)


# ------------------------------------------------------------------------------------------------
# import and round trips


@pytest.mark.heavy
def test_import_makes_an_mx_checkpoint_and_the_round_trip_is_byte_identical(ckpt, tmp_path):
    hf.export(ckpt, tmp_path / "hf1", mode="mx")
    hf.import_(tmp_path / "hf1", tmp_path / "back")
    state, manifest = read_ckpt(str(tmp_path / "back"))
    original, _ = read_ckpt(ckpt)
    mx_fqns = sorted(k[len("mx.") : -len(".rowwise_data")] for k in original if k.endswith(".rowwise_data"))
    assert sorted(k[len("mx.") : -len(".rowwise_data")] for k in state if k.endswith(".rowwise_data")) == mx_fqns
    fmt = MXFormat("e4m3", "floor")
    for fqn in mx_fqns:
        weight = state[f"model.{fqn}"]
        assert weight.dtype == torch.float32
        rows = dequantize(original[f"mx.{fqn}.rowwise_data"], original[f"mx.{fqn}.rowwise_scale"], "row")
        assert torch.equal(weight, rows)  # the weights the model computed with
        for axis, (data_plane, scale_plane) in PLANES.items():
            data, scale = quantize(weight, fmt, axis)
            assert same_bytes(state[f"mx.{fqn}.{data_plane}"], data) and same_bytes(
                state[f"mx.{fqn}.{scale_plane}"], scale
            )
        # floor quantization of dequantized values is idempotent here: the rowwise planes come back
        assert same_bytes(state[f"mx.{fqn}.rowwise_data"], original[f"mx.{fqn}.rowwise_data"])
    recorded = {p: b["mx"] for b in manifest["writer"]["plan"]["buffers"] if "mx" in b for p in b["params"]}
    assert sorted(recorded) == mx_fqns and all(v == {"element": "e4m3", "rule": "floor"} for v in recorded.values())
    hf.export(tmp_path / "back", tmp_path / "hf2", mode="mx")
    for name in sorted(os.listdir(tmp_path / "hf1")):
        assert (tmp_path / "hf1" / name).read_bytes() == (tmp_path / "hf2" / name).read_bytes(), name


def test_rceil_round_trip_keeps_the_values_not_always_the_bytes(tmp_path):
    """rceil is not idempotent on its own output: a block whose largest element rounds to exactly
    half the element maximum (224 in E4M3) is encoded again with half the scale and that maximum
    (448): the same values, other bytes. floor has no such case (its largest element lies in
    [256, 448])."""
    fmt = MXFormat("e4m3", "rceil")
    ckpt = mx_checkpoint(str(tmp_path / "ckpt"), fmt=fmt)
    hf.export(ckpt, tmp_path / "hf1", mode="mx")
    hf.import_(tmp_path / "hf1", tmp_path / "back")
    hf.export(tmp_path / "back", tmp_path / "hf2", mode="mx")
    a, b = read_hf(str(tmp_path / "hf1")), read_hf(str(tmp_path / "hf2"))
    changed = 0
    for name in a:
        if name.endswith(".weight") and name[: -len("weight")] + "weight_scale_inv" in a:
            scale = name[: -len("weight")] + "weight_scale_inv"
            assert torch.equal(dequantize(a[name], a[scale], "row"), dequantize(b[name], b[scale], "row")), name
            differs = a[scale].view(torch.uint8) != b[scale].view(torch.uint8)
            if differs.any():
                changed += 1
                rows, blocks = differs.nonzero(as_tuple=True)
                assert (
                    b[scale].view(torch.uint8)[differs].int() == a[scale].view(torch.uint8)[differs].int() - 1
                ).all()
                block_max = a[name].float().abs().reshape(a[name].shape[0], -1, 32).amax(-1)
                assert (block_max[rows, blocks] == 224).all()
        elif not name.endswith("weight_scale_inv"):
            assert same_bytes(a[name], b[name]), name
    assert changed > 0


@pytest.mark.parametrize(
    "preset,fmt",
    [
        ("tiny", MXFormat("e4m3", "floor")),
        ("tiny", MXFormat("e5m2", "rceil")),
        ("mixtral-like-small", MXFormat("e4m3", "floor")),
    ],
)
def test_transformers_loads_an_mx_export_dequantized(preset, fmt, tmp_path):
    """transformers' mxfp8 loader (its fine-grained FP8 quantizer) needs accelerate; on a machine
    without a GPU it dequantizes to bf16, giving exactly the model of the ``--from-mx`` bf16
    export (compared as loaded models: transformers fuses Mixtral's experts)."""
    pytest.importorskip("accelerate")
    transformers = pytest.importorskip("transformers")
    ckpt = mx_checkpoint(str(tmp_path / "ckpt"), preset, fmt)
    hf.export(ckpt, tmp_path / "mx", mode="mx")
    hf.export(ckpt, tmp_path / "deq", mode="from-mx", dtype="bfloat16")
    got = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "mx")).state_dict()
    want = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "deq")).state_dict()
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert same_bytes(got[name], tensor), name


# ------------------------------------------------------------------------------------------------
# hostile MX directories


def _rewrite(path, edit) -> None:
    """Apply ``edit(tensors, qc)`` to the tensors of a one-file export and its quantization_config,
    rewriting the file, the index and config.json."""
    (name,) = [n for n in os.listdir(path) if n.endswith(".safetensors")]
    tensors = read_hf(str(path))
    config = json.loads((path / "config.json").read_text())
    edit(tensors, config["quantization_config"])
    save_file(tensors, str(path / name), metadata={"format": "pt"})
    (path / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": {k: name for k in tensors}}))
    (path / "config.json").write_text(json.dumps(config))


Q = "model.layers.1.self_attn.q_proj"
CASES = {
    "scale shape": (
        lambda t, qc: t.__setitem__(f"{Q}.weight_scale_inv", t[f"{Q}.weight_scale_inv"][:, :1].contiguous()),
        rf"model-00001-of-00001.safetensors: tensor '{Q}.weight_scale_inv' has shape \(64, 1\), expected \(64, 2\)",
    ),
    "scale dtype": (
        lambda t, qc: t.__setitem__(f"{Q}.weight_scale_inv", t[f"{Q}.weight_scale_inv"].view(torch.uint8)),
        rf"model-00001-of-00001.safetensors: tensor '{Q}.weight_scale_inv' is U8, expected F8_E8M0",
    ),
    "missing scale": (
        lambda t, qc: t.pop(f"{Q}.weight_scale_inv"),
        rf"model-00001-of-00001.safetensors: quantized tensor '{Q}.weight' has no '{Q}.weight_scale_inv'",
    ),
    "weight dtype": (
        lambda t, qc: t.__setitem__(f"{Q}.weight", t[f"{Q}.weight"].to(torch.bfloat16)),
        rf"tensor '{Q}.weight' is BF16; quantization_config says MX e4m3 \(F8_E4M3\)",
    ),
    "unknown element": (
        lambda t, qc: qc["mfsdp_mx"].__setitem__("element", "e2m1"),
        r"config.json: quantization_config.mfsdp_mx.element: unknown MX element 'e2m1'",
    ),
    "unknown rule": (
        lambda t, qc: qc["mfsdp_mx"].__setitem__("rule", "round"),
        r"config.json: quantization_config.mfsdp_mx.rule: unknown MX scale rule 'round'",
    ),
    "no mfsdp_mx": (lambda t, qc: qc.pop("mfsdp_mx"), r"config.json: quantization_config: no 'mfsdp_mx'"),
    "other method": (
        lambda t, qc: qc.__setitem__("quant_method", "gptq"),
        r"config.json: quantization_config.quant_method 'gptq' is not supported",
    ),
    "fp8 method over MX scales": (
        lambda t, qc: qc.__setitem__("quant_method", "fp8"),
        r"config.json: quantization_config.quant_method 'fp8' is not supported with E8M0 scales",
    ),
    "other block": (
        lambda t, qc: qc.__setitem__("weight_block_size", [128, 128]),
        r"quantization_config.weight_block_size \[128, 128\]: MX blocks are \[1, 32\]",
    ),
    "half quantized": (
        lambda t, qc: qc["mfsdp_mx"]["quantized_modules"].remove("model.layers.0.self_attn.k_proj"),
        r"model.layers.0.self_attn.k_proj.weight not quantized but .*q_proj.weight, .*v_proj.weight are",
    ),
    "stray scale": (
        lambda t, qc: t.__setitem__("lm_head.weight_scale_inv", torch.zeros(256, 2).to(torch.float8_e8m0fnu)),
        r"unexpected tensors \(no mapping in llama\): lm_head.weight_scale_inv",
    ),
}


@pytest.fixture(scope="module")
def mx_dir(ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("mxdir") / "hf"
    hf.export(ckpt, out, mode="mx")
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_hostile_mx_directories_are_refused_in_one_line(case, mx_dir, tmp_path):
    edit, message = CASES[case]
    src = tmp_path / "hf"
    shutil.copytree(mx_dir, src)
    _rewrite(src, edit)
    with pytest.raises(ConversionError, match=message) as e:
        hf.import_(src, tmp_path / "ckpt")
    assert "\n" not in str(e.value)
    assert sorted(os.listdir(tmp_path)) == ["hf"]  # nothing written


def test_cli_mx_paths_and_a_refusal(ckpt, mx_dir, tmp_path):
    runner = CliRunner()
    result = runner.invoke(main, ["export-hf", ckpt, str(tmp_path / "mx"), "--mx"])
    assert result.exit_code == 0, result.output
    assert header_dtypes(str(tmp_path / "mx"))[f"{Q}.weight_scale_inv"] == "F8_E8M0"
    result = runner.invoke(main, ["export-hf", ckpt, str(tmp_path / "deq"), "--from-mx", "--dtype", "bfloat16"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(main, ["export-hf", ckpt, str(tmp_path / "both"), "--from-mx", "--mx"])
    assert result.exit_code != 0 and "exclude each other" in result.output
    result = runner.invoke(main, ["import-hf", str(tmp_path / "mx"), str(tmp_path / "back")])
    assert result.exit_code == 0, result.output
    bad = tmp_path / "bad"
    shutil.copytree(mx_dir, bad)
    _rewrite(bad, CASES["unknown rule"][0])
    result = runner.invoke(main, ["import-hf", str(bad), str(tmp_path / "never")])
    assert result.exit_code != 0
    lines = [line for line in result.output.splitlines() if line.startswith("error")]
    assert len(lines) == 1 and "unknown MX scale rule 'round'" in lines[0]
    assert not (tmp_path / "never").exists()
