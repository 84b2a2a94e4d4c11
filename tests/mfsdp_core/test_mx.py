"""mfsdp_core.mx (the pure-PyTorch MXFP8 reference): bitwise parity with torchao's ``to_mx`` on
every edge family, round trips through ``dequantize``, and the API's refusals.

torchao is a test dependency installed with ``--no-deps`` (the Makefile does it) so that it never
pulls another torch, into a directory of its own (:mod:`tests.torchao_ref`, put on the path here);
its compiled extensions do not load on this torch, but the pure-Python MX reference
(``torchao.prototype.mx_formats.mx_tensor.to_mx``) imports and is what we compare with. The
parity tests skip, saying so, only when that directory is absent (torchao not installed); when it
is there, an import that fails is a failure."""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mfsdp_core import mx
from mfsdp_core.mx import BLOCK, MXFormat
from tests.torchao_ref import TORCHAO_DIR

FORMATS = [MXFormat(e, r) for e in ("e4m3", "e5m2") for r in ("floor", "rceil")]
FMT_IDS = [str(f).replace(" ", "-") for f in FORMATS]


def _f32(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int64).to(torch.int32).view(torch.float32)


def input_families(seed: int = 0) -> dict[str, torch.Tensor]:
    """Named float32 [64, 128] inputs covering the edge cases; structure runs along rows (use the
    transpose too so that columnwise blocks see it). Shared with test_mx_native.py."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    fam: dict[str, torch.Tensor] = {}
    fam["magnitudes_cols"] = rand(64, 128) * torch.logspace(-30, 30, 128)
    fam["magnitudes_rows"] = rand(64, 128) * torch.logspace(-30, 30, 64)[:, None]
    z = rand(64, 128)
    z[::2, :BLOCK] = 0.0
    z[1::4, BLOCK : 2 * BLOCK] = -0.0
    z[:, 3 * BLOCK] = 0.0
    z[5, :] = 0.0
    fam["zeros"] = z
    sub = _f32(torch.randint(1, 1 << 23, (64, 128), generator=g)) * torch.where(rand(64, 128) > 0, 1.0, -1.0)
    sub[::3, :BLOCK] *= 2.0**100  # subnormal mixed with normal blocks
    sub[1::3, BLOCK] = 1.0  # one normal element in a subnormal block
    fam["f32_subnormals"] = sub
    fp8s = rand(64, 128) * 2.0**-12  # elements in the FP8 subnormal range of a block scaled for 1
    fp8s[:, ::BLOCK] = 1.0
    fp8s[::2, 1::BLOCK] = -448.0 * 2.0**-20
    fam["fp8_subnormals"] = fp8s
    sp = rand(64, 128)
    sp[0, 3] = float("nan")
    sp[1, 5] = -float("nan")
    sp[2, 7] = float("inf")
    sp[3, 9] = -float("inf")
    sp[4, 1], sp[4, 2] = float("nan"), float("inf")  # NaN wins over inf
    sp[5, 33], sp[5, 34] = -float("inf"), float("inf")
    sp[6, 64:96] = float("nan")
    sp[7, 96:128] = -float("inf")
    sp[8, :BLOCK] = torch.where(rand(BLOCK) > 0, float("nan"), -float("nan"))
    sp[9, 40] = -float("nan")
    sp[9, 41] = float("inf")
    sp[10, :BLOCK] = 0.0
    sp[10, 0] = float("nan")
    fam["nan_inf"] = sp
    big = rand(64, 128) * 3.0e38
    big[::2, ::7] = torch.finfo(torch.float32).max
    big[1::2, ::5] = -torch.finfo(torch.float32).max
    fam["near_f32_max"] = big.clamp(-torch.finfo(torch.float32).max, torch.finfo(torch.float32).max)
    # amax mantissa >= 1.75 saturates under floor
    sat = rand(64, 128).abs() * 0.5
    sat[:, ::BLOCK] = torch.rand(64, 128 // BLOCK, generator=g) * 0.25 + 1.75
    sat *= torch.exp2(torch.randint(-100, 100, (64, 1), generator=g).float())
    fam["saturating"] = sat
    # amax a few ulps above max_elem * 2^e: torch.log2 rounds these down under rceil
    e = torch.randint(-126, 110, (64, 1), generator=g).float()
    for name, mx_val in (("near_pow2_e4m3", 448.0), ("near_pow2_e5m2", 57344.0)):
        base = (mx_val * torch.exp2(e)).expand(64, 128).contiguous()
        bits = base.view(torch.int32) + torch.randint(-2, 48, (64, 128), generator=g, dtype=torch.int32)
        near = bits.view(torch.float32) * torch.where(rand(64, 128) > 0, 1.0, -1.0)
        near[:, 1::2] *= 0.3  # only some elements are the block's amax
        fam[name] = near
    fam["random_bits"] = _f32(torch.randint(0, 1 << 32, (64, 128), generator=g))
    tiny = rand(64, 128) * torch.logspace(-45, -30, 64)[:, None]
    fam["tiny_blocks"] = tiny
    mixed = rand(64, 128)
    mixed[:, 1::3] *= 1e20
    mixed[:, 2::5] *= 1e-20
    mixed[::4, 10] = float("nan")
    mixed[1::4, 70] = -float("inf")
    fam["mixed"] = mixed
    return fam


FAMILIES = input_families()


@pytest.fixture(scope="module")
def torchao_to_mx():
    """torchao's reference cast, or a skip that says torchao is not installed."""
    if not os.path.isdir(TORCHAO_DIR):
        pytest.skip(
            f"torchao MX reference not installed in {TORCHAO_DIR}; "
            f"install it with: pip install --no-deps --target {TORCHAO_DIR} 'torchao==0.18.0'"
        )
    if TORCHAO_DIR not in sys.path:
        sys.path.append(TORCHAO_DIR)  # last: the wheel also has a top-level "test" package
    from torchao.prototype.mx_formats.mx_tensor import ScaleCalculationMode, to_mx

    def cast(x: torch.Tensor, fmt: MXFormat, axis: str) -> tuple[torch.Tensor, torch.Tensor]:
        mode = ScaleCalculationMode.FLOOR if fmt.rule == "floor" else ScaleCalculationMode.RCEIL
        src = x.contiguous() if axis == "row" else x.t().contiguous()
        scale, data = to_mx(src, fmt.dtype, BLOCK, mode)
        data, scale = data.view(torch.uint8), scale.view(torch.uint8)
        return (data, scale) if axis == "row" else (data.t(), scale.t())

    return cast


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def assert_same_bytes(
    x: torch.Tensor, got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor], what: str
) -> None:
    """Data and scale bytes equal; on a mismatch, name the first differing element and its input."""
    for i, name in ((1, "scale"), (0, "data")):
        a, b = _bytes(got[i]), _bytes(want[i])
        assert a.shape == b.shape, f"{what}: {name} shape {tuple(a.shape)} != {tuple(b.shape)}"
        diff = (a != b).nonzero()
        if len(diff):
            r, c = diff[0].tolist()
            raise AssertionError(
                f"{what}: {len(diff)} {name} bytes differ, first at ({r}, {c}): {a[r, c].item():#04x} "
                f"!= {b[r, c].item():#04x}" + (f" for x = {x[r, c].item()!r}" if name == "data" else "")
            )


# ---------------------------------------------------------------------------------------------
# parity with torchao


@pytest.mark.parametrize("fmt", FORMATS, ids=FMT_IDS)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_families_match_torchao(torchao_to_mx, fmt: MXFormat, family: str) -> None:
    for orient, x in (("x", FAMILIES[family]), ("x.T", FAMILIES[family].t().contiguous())):
        for axis in mx.AXES:
            got = mx.quantize_reference(x, fmt, axis)
            assert got[0].dtype == fmt.dtype and got[1].dtype == torch.float8_e8m0fnu
            assert_same_bytes(x, got, torchao_to_mx(x, fmt, axis), f"{fmt} {family} {orient} {axis}")


@pytest.mark.parametrize("fmt", FORMATS, ids=FMT_IDS)
def test_every_float32_exponent_and_special(torchao_to_mx, fmt: MXFormat) -> None:
    """One block per float32 exponent field (0..255, so zero/subnormal/inf/NaN amax too), with
    random mantissas and signs below it: every scale byte either rule can produce."""
    g = torch.Generator().manual_seed(1)
    exp = torch.arange(256, dtype=torch.int64)[:, None]
    mant = torch.randint(0, 1 << 23, (256, BLOCK), generator=g)
    sign = torch.randint(0, 2, (256, BLOCK), generator=g) << 31
    amax_row = (exp << 23) | mant
    lower = ((exp - torch.randint(0, 30, (256, BLOCK), generator=g)).clamp(min=0) << 23) | mant
    x = _f32(torch.where(torch.arange(BLOCK) == 0, amax_row, lower) | sign)
    x = torch.cat([x, x.flip(1)], 1)  # 256 x 64
    x = torch.cat([x, -x.flip(0)], 0)  # 512 x 64: both axes see every exponent
    for axis in mx.AXES:
        assert_same_bytes(x, mx.quantize_reference(x, fmt, axis), torchao_to_mx(x, fmt, axis), f"{fmt} {axis}")


_f32_elems = st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True)


@st.composite
def _matrices(draw: st.DrawFn) -> torch.Tensor:
    """A random [32a, 32b] matrix at some magnitude with up to 64 drawn float32 values (NaN, inf,
    subnormals, extremes) scattered into it, so that blocks mix the specials with ordinary values."""
    m = BLOCK * draw(st.integers(1, 3))
    k = BLOCK * draw(st.integers(1, 3))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    scale = draw(st.sampled_from([1.0, 1e-38, 1e-20, 1e20, 1e30, 0.0]))
    x = torch.randn(m, k, generator=g) * scale
    vals = draw(st.lists(_f32_elems, min_size=1, max_size=64))
    where = torch.randperm(m * k, generator=g)[: len(vals)]
    x.view(-1)[where] = torch.tensor(vals[: len(where)], dtype=torch.float32)
    return x


@pytest.mark.parametrize("fmt", FORMATS, ids=FMT_IDS)
@settings(max_examples=40, deadline=None)
@given(x=_matrices())
def test_hypothesis_matches_torchao(torchao_to_mx, fmt: MXFormat, x: torch.Tensor) -> None:
    for axis in mx.AXES:
        assert_same_bytes(x, mx.quantize_reference(x, fmt, axis), torchao_to_mx(x, fmt, axis), f"{fmt} {axis}")


@pytest.mark.parametrize("fmt", FORMATS, ids=FMT_IDS)
def test_random_sweep_matches_torchao(torchao_to_mx, fmt: MXFormat) -> None:
    g = torch.Generator().manual_seed(7)
    for i in range(12):
        m, k = BLOCK * int(torch.randint(1, 6, (1,), generator=g)), BLOCK * int(torch.randint(1, 6, (1,), generator=g))
        x = torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-140, 120, (m, 1), generator=g).float())
        if i % 3 == 0:
            x = _f32(torch.randint(0, 1 << 32, (m, k), generator=g))
        for axis in mx.AXES:
            assert_same_bytes(x, mx.quantize_reference(x, fmt, axis), torchao_to_mx(x, fmt, axis), f"{fmt} {axis} {i}")


# ---------------------------------------------------------------------------------------------
# semantics we rely on (they hold because torchao does the same; stated here so a change shows)


def test_rules_on_single_blocks() -> None:
    def byte(vals: list[float], fmt: MXFormat) -> int:
        x = torch.tensor(vals + [0.0] * (BLOCK - len(vals)), dtype=torch.float32)[None]
        return int(mx.quantize_reference(x, fmt, "row")[1].view(torch.uint8))

    e4f, e4r, e5f, e5r = FORMATS[0], FORMATS[1], FORMATS[2], FORMATS[3]
    assert byte([1.0], e4f) == 127 - 8 and byte([1.0], e5f) == 127 - 15
    assert byte([1.9], e4f) == 127 - 8  # floor truncates the mantissa
    assert byte([448.0], e4r) == 127 and byte([449.0], e4r) == 128  # rceil rounds up
    assert byte([57344.0], e5r) == 127
    assert byte([0.0], e4f) == 0 and byte([0.0], e4r) == 0
    assert byte([1e-40], e4f) == 0 and byte([1e-40], e4r) == 0
    assert byte([float("inf")], e4f) == 247 and byte([float("inf")], e5f) == 240
    assert byte([float("inf")], e4r) == 254 and byte([float("inf")], e5r) == 254
    for f in FORMATS:
        assert byte([float("nan"), float("inf")], f) == 0xFF
    # torch.log2 rounds log2(448 * 2^100 * (1 + 2^-23)) to exactly 100: rceil keeps 2^100
    just_above = (torch.tensor(448.0 * 2.0**100).view(torch.int32) + 1).view(torch.float32).item()
    assert byte([just_above], e4r) == 127 + 100


def test_nan_and_inf_elements() -> None:
    x = torch.zeros(1, BLOCK)
    x[0, :4] = torch.tensor([1.0, -2.0, float("inf"), -float("nan")])
    d_floor = mx.quantize_reference(x, FORMATS[0], "row")[0].view(torch.uint8)[0, :4].tolist()
    d_rceil = mx.quantize_reference(x, FORMATS[1], "row")[0].view(torch.uint8)[0, :4].tolist()
    assert d_floor[:2] == [0x00, 0x80]  # finite elements of a NaN block become +-0 under floor
    assert all(v & 0x7F == 0x7F for v in d_floor[2:])  # inf and NaN become NaN
    assert d_rceil == [0x7F] * 4  # rceil: every element of a NaN block is +NaN
    y = torch.zeros(1, BLOCK)
    y[0, :3] = torch.tensor([float("inf"), -float("inf"), 1.0])
    assert mx.quantize_reference(y, FORMATS[0], "row")[0].view(torch.uint8)[0, :2].tolist() == [0x7E, 0xFE]


# ---------------------------------------------------------------------------------------------
# dequantize


def _roundtrip_bound(x: torch.Tensor, scale: torch.Tensor, fmt: MXFormat, axis: str) -> torch.Tensor:
    """Largest allowed |dequantize(quantize(x)) - x|: FP8 rounding (half an ulp: 2^-4 relative for
    E4M3, 2^-3 for E5M2) plus half the FP8 subnormal step times the scale, plus, under floor, the
    saturation of elements in (max, 2^(emax+1)) (at most 1/8 of them)."""
    s = torch.exp2(scale.view(torch.uint8).float() - 127).repeat_interleave(BLOCK, dim=1 if axis == "row" else 0)
    rel = 2.0**-4 if fmt.element == "e4m3" else 2.0**-3
    sub = 2.0**-10 if fmt.element == "e4m3" else 2.0**-17
    if fmt.rule == "floor":
        rel += 1.0 / 8
    return x.abs() * rel + s * sub * 1.0001


@pytest.mark.parametrize("fmt", FORMATS, ids=FMT_IDS)
@pytest.mark.parametrize("axis", mx.AXES)
def test_dequantize_roundtrip(fmt: MXFormat, axis: str) -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(128, 96, generator=g) * torch.exp2(torch.randint(-90, 90, (128, 1), generator=g).float())
    x = x if axis == "row" else x.t().contiguous()[:96, :128]
    data, scale = mx.quantize_reference(x, fmt, axis)
    y = mx.dequantize(data, scale, axis)
    assert y.dtype == torch.float32 and y.shape == x.shape
    err = (y - x).abs()
    bound = _roundtrip_bound(x, scale, fmt, axis)
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item()}"
    # the largest element of each block keeps 3 (E4M3) / 2 (E5M2) mantissa bits: within an ulp
    if fmt.rule == "rceil":
        assert torch.allclose(y.abs().amax(), x.abs().amax(), rtol=2.0**-3)


def test_dequantize_specials() -> None:
    x = torch.randn(2, 2 * BLOCK)
    x[0, 3] = float("nan")
    for fmt in FORMATS:
        y = mx.dequantize(*mx.quantize_reference(x, fmt, "row"), "row")
        assert bool(y[0, :BLOCK].isnan().all()) and not bool(y[0, BLOCK:].isnan().any())
        assert bool(y[1].isfinite().all())
    # floor's smallest scale: data were divided by 2^-126 but the byte says 2^-127, so a block
    # below 2^-118 comes back at half its value (torchao does the same)
    tiny = torch.full((1, BLOCK), 2.0**-120)
    d, s = mx.quantize_reference(tiny, FORMATS[0], "row")
    assert int(s.view(torch.uint8)) == 0
    assert torch.equal(mx.dequantize(d, s, "row"), tiny / 2)


# ---------------------------------------------------------------------------------------------
# API


def test_shapes_and_dtypes() -> None:
    x = torch.randn(64, 96)
    d, s = mx.quantize(x, MXFormat(), "row", backend="reference")
    assert d.shape == (64, 96) and s.shape == (64, 3) and d.dtype == torch.float8_e4m3fn
    d, s = mx.quantize(x, MXFormat("e5m2", "rceil"), "col", backend="reference")
    assert d.shape == (64, 96) and s.shape == (2, 96) and d.dtype == torch.float8_e5m2
    assert s.dtype == torch.float8_e8m0fnu and d.is_contiguous() and s.is_contiguous()
    # columnwise is rowwise of the transpose, transposed back
    dt, st_ = mx.quantize(x.t().contiguous(), MXFormat("e5m2", "rceil"), "row", backend="reference")
    assert torch.equal(d.view(torch.uint8), dt.view(torch.uint8).t()) and torch.equal(
        s.view(torch.uint8), st_.view(torch.uint8).t()
    )
    # a non-contiguous input is fine
    assert torch.equal(
        mx.quantize(x.t(), MXFormat(), "row", backend="reference")[0].view(torch.uint8),
        mx.quantize(x.t().contiguous(), MXFormat(), "row", backend="reference")[0].view(torch.uint8),
    )


@pytest.mark.parametrize(
    "shape,axis,needle",
    [((4, 33), "row", "(4, 33)"), ((33, 64), "col", "(33, 64)"), ((64,), "row", "2-D"), ((2, 32, 32), "col", "2-D")],
)
def test_bad_shapes_refused_in_one_line(shape: tuple[int, ...], axis: str, needle: str) -> None:
    for backend in ("reference", "auto"):
        with pytest.raises(ValueError) as e:
            mx.quantize(torch.zeros(shape), MXFormat(), axis, backend=backend)
        msg = str(e.value)
        assert "\n" not in msg and needle in msg and repr(axis) in msg, msg


def test_bad_arguments() -> None:
    x = torch.zeros(32, 32)
    with pytest.raises(ValueError, match="float32"):
        mx.quantize(x.bfloat16(), MXFormat(), "row")
    with pytest.raises(ValueError, match="'diag'"):
        mx.quantize(x, MXFormat(), "diag")
    with pytest.raises(ValueError, match="'fast'"):
        mx.quantize(x, MXFormat(), "row", backend="fast")
    with pytest.raises(ValueError, match="shape"):
        mx.dequantize(torch.zeros(32, 32, dtype=torch.float8_e4m3fn), torch.zeros(32, 2, dtype=torch.uint8), "row")


def test_format() -> None:
    assert MXFormat().dtype == torch.float8_e4m3fn and MXFormat("e5m2").dtype == torch.float8_e5m2
    assert str(MXFormat("e5m2", "rceil")) == "mxfp8 e5m2 rceil" and str(MXFormat()) == "mxfp8 e4m3 floor"
    for f in FORMATS:
        assert MXFormat.from_dict(f.to_dict()) == f
    assert MXFormat().to_dict() == {"element": "e4m3", "rule": "floor"}
    with pytest.raises(ValueError, match="'e3m4'"):
        MXFormat("e3m4")
    with pytest.raises(ValueError, match="'round'"):
        MXFormat("e4m3", "round")
    with pytest.raises(ValueError, match="unknown keys"):
        MXFormat.from_dict({"element": "e4m3", "block": 32})
    assert math.isclose(MXFormat().max, 448.0) and MXFormat("e5m2").emax == 15
