"""The native MXFP8 CPU cast (csrc/mx_cast.cpp via mfsdp_core.mx_native): byte for byte equal to
the reference mfsdp_core.mx on the same input families as test_mx.py and on random shapes, the
fallback with its one-line notice, and the loader's build / lock / failure behaviour.

The first ``load`` compiles the kernel (~30 s on 2 CPUs; pytest-timeout allows 900 s); later runs
find it in the cache. These tests skip, with the loader's reason, only where it cannot build (no
compiler, no ninja)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

from mfsdp_core import mx, mx_native
from mfsdp_core.mx import MXFormat
from tests.mfsdp_core.test_mx import FAMILIES, FMT_IDS, FORMATS, assert_same_bytes

pytestmark = pytest.mark.heavy  # slow (the inner loop's 8 minutes); CI runs it

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def kernel():
    """The compiled CPU module (built here on first use), or a skip naming why it is unavailable."""
    module = mx_native.load("cpu")
    if module is None:
        pytest.skip(f"native MXFP8 cast unavailable: {mx_native.unavailable_reason('cpu')}")
    return module


def _both(x: torch.Tensor, fmt: MXFormat, axis: str, what: str) -> None:
    want = mx.quantize_reference(x, fmt, axis)
    got = mx.quantize(x, fmt, axis, backend="native")
    assert got[0].dtype == fmt.dtype and got[1].dtype == torch.float8_e8m0fnu
    assert_same_bytes(x, got, want, what)


@pytest.mark.timeout(900)
def test_builds_and_loads(kernel) -> None:
    assert mx_native.unavailable_reason("cpu") is None
    assert mx_native.build_dir("cpu").is_dir()
    x = torch.randn(32, 32)
    assert mx.quantize(x, MXFormat(), "row")[0].dtype == torch.float8_e4m3fn  # auto picks native, no notice


@pytest.mark.parametrize("fmt", FORMATS, ids=FMT_IDS)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_families_match_reference(kernel, fmt: MXFormat, family: str) -> None:
    for orient, x in (("x", FAMILIES[family]), ("x.T", FAMILIES[family].t().contiguous())):
        for axis in mx.AXES:
            _both(x, fmt, axis, f"{fmt} {family} {orient} {axis}")


@pytest.mark.parametrize("fmt", FORMATS, ids=FMT_IDS)
def test_random_shapes(kernel, fmt: MXFormat) -> None:
    g = torch.Generator().manual_seed(11)
    shapes = [(32, 32), (32, 96), (96, 32), (32, 4096), (64, 288), (160, 544), (7 * 32, 3 * 32)]
    for i, (m, k) in enumerate(shapes):
        x = torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-130, 120, (m, 1), generator=g).float())
        if i % 2:
            x = torch.randint(0, 1 << 32, (m, k), generator=g).to(torch.int32).view(torch.float32)
        for axis in mx.AXES:
            _both(x, fmt, axis, f"{fmt} {axis} {(m, k)}")
    # non-blocked dims that are not multiples of 32
    _both(torch.randn(5, 64, generator=g), fmt, "row", f"{fmt} row (5, 64)")
    _both(torch.randn(64, 5, generator=g), fmt, "col", f"{fmt} col (64, 5)")
    _both(torch.randn(64, 300, generator=g), fmt, "col", f"{fmt} col (64, 300)")  # a partial column tile
    _both(torch.randn(32, 64, generator=g).t(), fmt, "col", f"{fmt} col non-contiguous")
    _both(torch.zeros(0, 64), fmt, "row", f"{fmt} row empty")


def test_rceil_table_reproduces_torch_log2(kernel) -> None:
    """The table the kernel gets gives, for random d, the byte torch's ceil(log2(d)) gives."""
    table = mx_native.rceil_table()
    g = torch.Generator().manual_seed(5)
    bits = torch.randint(0, 0x7F800000, (1 << 20,), generator=g, dtype=torch.int64)
    near = (torch.randint(0, 255, (1 << 18,), generator=g) << 23) + torch.randint(0, 64, (1 << 18,), generator=g)
    bits = torch.cat([bits, near]).to(torch.int32)
    d = bits.view(torch.float32)
    want = (torch.clamp(torch.ceil(torch.log2(d)), -127, 127) + 127).to(torch.int64)
    e, m = (bits.to(torch.int64) >> 23) & 0xFF, bits.to(torch.int64) & 0x7FFFFF
    normal = (e + (m > table.to(torch.int64)[e]).long()).clamp(max=254)
    sub = (m > (1 << 22) + int(table[0])).long()
    got = torch.where(e == 0, sub, normal)
    assert torch.equal(got, want)


def test_kernel_runs_on_torchs_threads(kernel) -> None:
    """The kernel's parallel loops use torch's intra-op threads (built without OpenMP against an
    OpenMP torch, they would silently run on one)."""
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            assert kernel.parallel_threads() == n
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("fmt", FORMATS, ids=FMT_IDS)
def test_groups_and_tiles_with_and_without_nan(kernel, fmt: MXFormat) -> None:
    """The kernel takes a vector path for a group of row blocks (64) or a tile of columns (256)
    without NaN, and a general one for a group or tile holding one: in one tensor, groups and tiles
    of both kinds, with amaxes at and just above the rceil power-of-two edges (the blocks the
    vector scale loop hands to the exact table pass), zero blocks, subnormal and inf ones."""
    g = torch.Generator().manual_seed(5)
    m, k = 96, 2048  # rows: 64 blocks per row, 96 groups; cols: 8 tiles per 32-row strip
    edge = 448.0 if fmt.element == "e4m3" else 57344.0
    e = torch.randint(-100, 100, (m, 1), generator=g).float()
    bits = (edge * torch.exp2(e)).expand(m, k).contiguous().view(torch.int32)
    bits = bits + torch.randint(-3, 6000, (m, k), generator=g, dtype=torch.int32)  # mantissas 0..~6000 above the edge
    x = bits.view(torch.float32) * torch.where(torch.rand(m, k, generator=g) > 0.5, 1.0, -1.0)
    x[:, 1::2] *= 0.25  # only some elements are their block's amax
    x[40:72, 512:544] = 0.0  # zero blocks
    x[10, 1000:1032] = 1e-42  # a subnormal row block
    x[20, 1500] = float("inf")
    x[70, 300] = float("nan")  # one group of row blocks and one column tile with NaN
    x[5, 1900] = 3.0e38  # an amax whose rceil scale byte saturates
    for axis in mx.AXES:
        _both(x, fmt, axis, f"{fmt} {axis} mixed groups")


@pytest.mark.heavy
@pytest.mark.parametrize("fmt", FORMATS, ids=FMT_IDS)
def test_large_and_multithreaded(kernel, fmt: MXFormat) -> None:
    """Shapes that span many parallel tasks (rows: 2048 blocks per task; cols: 256-column tiles),
    with 1 and 2 threads: same bytes either way."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(256, 16384, generator=g) * torch.exp2(torch.randint(-60, 60, (256, 1), generator=g).float())
    x[::17, ::13] = float("nan")
    x[3::19, 5::11] = -float("inf")
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for axis in mx.AXES:
                _both(x, fmt, axis, f"{fmt} {axis} threads={n}")
    finally:
        torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------------------
# fallback and loader


def test_fallback_notice_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the native module forced unavailable, auto falls back to the reference, warning once
    with the reason in one line; backend="native" raises with the reason."""
    monkeypatch.setattr(mx_native, "_modules", {"cpu": None})
    monkeypatch.setattr(mx_native, "_reasons", {"cpu": "no C++ compiler (forced by a test)"})
    monkeypatch.setattr(mx, "_notice_given", False)
    x = torch.randn(64, 64)
    with pytest.warns(mx.MXNativeUnavailableWarning) as rec:
        got = mx.quantize(x, MXFormat("e5m2", "rceil"), "col")
    assert len(rec) == 1
    msg = str(rec[0].message)
    assert "no C++ compiler (forced by a test)" in msg and "reference" in msg and "\n" not in msg
    assert_same_bytes(x, got, mx.quantize_reference(x, MXFormat("e5m2", "rceil"), "col"), "fallback")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mx.quantize(x, MXFormat(), "row")  # no second notice
    with pytest.raises(RuntimeError, match="forced by a test"):
        mx.quantize(x, MXFormat(), "row", backend="native")


def test_cuda_reason_without_gpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is present; the CUDA kernel is not exercised by this suite")
    assert mx_native.load("cuda") is None
    assert mx_native.unavailable_reason("cuda") == "no CUDA device"


def _run(code: str, env_dir: Path, timeout: float = 600) -> subprocess.Popen:
    env = {
        "TORCH_EXTENSIONS_DIR": str(env_dir),
        "PYTHONPATH": str(REPO),
        "PATH": "/usr/bin:/bin:/usr/local/bin",
        "HOME": str(env_dir),
    }
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.mark.heavy
@pytest.mark.timeout(900)
def test_build_failure_is_one_line_and_import_survives(tmp_path: Path) -> None:
    """A kernel source that does not compile (here: a header the machine lacks, as when Python's
    or torch's development headers are missing; the compiler stops at once): ``import mfsdp_core``
    is unaffected, ``load`` returns None with the compiler's first error line, and auto quantize
    falls back with that reason."""
    src = tmp_path / "csrc"
    src.mkdir()
    (src / "mx_cast.cpp").write_text(
        "#include <mfsdp_no_such_header.h>\n#include <torch/extension.h>\nthis is not C++;\n"
    )
    p = _run(
        f"""
        import warnings, torch
        import mfsdp_core
        from mfsdp_core import mx, mx_native
        from pathlib import Path
        mx_native.source_dir = lambda: Path({str(src)!r})
        assert mx_native.load("cpu") is None
        print("REASON", mx_native.unavailable_reason("cpu"))
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            mx.quantize(torch.zeros(32, 32), mx.MXFormat(), "row")
        print("WARN", len(w), w[0].message)
    """,
        tmp_path / "ext",
    )
    out, _ = p.communicate(timeout=600)
    assert p.returncode == 0, out
    reason = next(ln for ln in out.splitlines() if ln.startswith("REASON"))
    assert "error" in reason.lower() and len(reason) < 400, reason
    assert "WARN 1" in out, out


@pytest.mark.heavy
@pytest.mark.timeout(900)
def test_concurrent_builds_and_stale_baton(tmp_path: Path) -> None:
    """Two processes load into a fresh cache dir at once, where a killed builder left
    cpp_extension's baton file behind: both get the module (one builds, one waits on the flock),
    and the results agree."""
    ext = tmp_path / "ext"
    (ext / "mfsdp_mx_cast").mkdir(parents=True)
    (ext / "mfsdp_mx_cast" / "lock").write_text("")  # stale baton
    code = """
        import torch
        from mfsdp_core import mx, mx_native
        k = mx_native.load("cpu")
        assert k is not None, mx_native.unavailable_reason("cpu")
        x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
        d, s = mx.quantize(x, mx.MXFormat(), "row", backend="native")
        print("SUM", int(d.view(torch.uint8).long().sum()), int(s.view(torch.uint8).long().sum()))
    """
    procs = [_run(code, ext) for _ in range(2)]
    outs = [p.communicate(timeout=800)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out
    sums = [next(ln for ln in out.splitlines() if ln.startswith("SUM")) for out in outs]
    assert sums[0] == sums[1]
    assert not (ext / "mfsdp_mx_cast" / "lock").exists()
