"""Loader of the native MXFP8 cast kernels in ``csrc/`` (``mx_cast.cpp`` for CPU, ``mx_cast.cu``
for CUDA), built on first use with ``torch.utils.cpp_extension.load``.

Why a loader: the kernels are optional. ``load(device)`` returns the compiled module or None and
keeps the reason (one line: no compiler, no GPU, the first line of a build error) for
``mfsdp_core.mx``'s fallback notice; nothing here runs at import time, and no failure escapes
``load`` as an exception, so ``import mfsdp_core`` never depends on a compiler.

Where: ``$TORCH_EXTENSIONS_DIR/<name>`` when that variable is set (cpp_extension's own rule),
else ``$XDG_CACHE_HOME/mfsdp/torch_extensions/<python>_<torch>/<name>`` (``~/.cache`` by default).
The torch version is part of the path because the module links against that torch's ABI.

Several ranks building at once: cpp_extension serialises builders of one build directory with a
file baton (``<dir>/lock``, created with O_EXCL, removed after the build; the others poll until it
is gone and then import). A builder that dies leaves that file behind and every later load would
wait forever, so this loader first takes an ``fcntl.flock`` on ``<dir>.flock`` (released by the
kernel when a process dies), and while holding it removes a baton nobody can hold any more.

Saying when it builds: a build takes about a minute, so one line goes to stderr whenever one runs,
``building the MXFP8 native kernel (first use or sources changed; about a minute) in <dir>``.
Whether one runs is ninja's decision, not the cache's content: in a new process cpp_extension
always (re)writes ``build.ninja`` and runs ninja, which compiles when the source, a header or
the command line (flags) changed since the ``.so`` there was made, or when it is missing. So the
notice asks ninja itself (:func:`build_pending`: ``ninja -n``, a dry run) at the moment
cpp_extension is about to run it, against the ``build.ninja`` it has just written: a stale
``.so`` is announced (and ``built the MXFP8 native kernel in <n> s`` after it), an up-to-date one
is loaded without a word.

rceil needs a table measured from ``torch.log2`` (see ``csrc/mx_cast.cpp`` and the docstring of
``mfsdp_core.mx``); ``rceil_table(device)`` measures and checks it once per process and device.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Iterator

import torch

__all__ = ["load", "unavailable_reason", "quantize", "build_dir", "rceil_table", "source_dir", "build_pending"]

_NAMES = {"cpu": ("mfsdp_mx_cast", "mx_cast.cpp"), "cuda": ("mfsdp_mx_cast_cuda", "mx_cast.cu")}
# -fno-trapping-math lets GCC if-convert the cast (vectorize it); it changes no result. No
# -ffast-math: NaN, subnormal and signed-zero bits must come out as torch computes them.
_CFLAGS = ["-O3", "-fopenmp-simd", "-fno-math-errno", "-fno-trapping-math"]

_LOCK_TIMEOUT_S = 1800.0  # a first build takes ~1 min; ranks wait for it rather than build twice
NOTICE = "building the MXFP8 native kernel (first use or sources changed; about a minute) in {}"

_modules: dict[str, ModuleType | None] = {}
_reasons: dict[str, str] = {}
_tables: dict[str, torch.Tensor] = {}


def source_dir() -> Path:
    """The kernels' sources: ``mfsdp_core/_csrc/`` of an installed wheel (``csrc/`` packaged as
    data, setup.py), else ``csrc/`` of this checkout (a source tree or an editable install)."""
    here = Path(__file__).resolve().parent
    installed = here / "_csrc"
    return installed if installed.is_dir() else here.parent / "csrc"


def build_dir(device: str = "cpu") -> Path:
    """Where the kernel for ``device`` is built and cached (see the module docstring)."""
    name = _NAMES[device][0]
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return Path(root) / name
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    tag = f"py{sys.version_info.major}{sys.version_info.minor}_torch{torch.__version__.replace('+', '_')}"
    return cache / "mfsdp" / "torch_extensions" / tag / name


def unavailable_reason(device: str = "cpu") -> str | None:
    """Why ``load(device)`` returned None, in one line; None if it loaded or was not tried."""
    return _reasons.get(device)


def _first_line(e: BaseException) -> str:
    """The informative line of a build error: the first compiler 'error:' line, else the first line."""
    text = str(e)
    for line in text.splitlines():
        if "error:" in line or "Error:" in line:
            return line.strip()[:300]
    first = next((ln for ln in text.splitlines() if ln.strip()), type(e).__name__)
    return f"{type(e).__name__}: {first.strip()[:300]}"


def _why_not(device: str) -> str | None:
    """A reason not to try building for ``device`` at all, or None."""
    if device not in _NAMES:
        return f"no native kernel for device type {device!r}"
    if not (source_dir() / _NAMES[device][1]).is_file():
        return f"kernel source {_NAMES[device][1]} not found under {source_dir()} (not a source checkout)"
    if device == "cuda":
        from torch.utils.cpp_extension import CUDA_HOME

        if not torch.cuda.is_available():
            return "no CUDA device"
        if CUDA_HOME is None:
            return "no CUDA toolkit (CUDA_HOME)"
    return None


def build_pending(out: Path) -> bool:
    """Whether ninja, run in build directory ``out``, would compile or link anything: ninja's own
    answer (``ninja -n``, a dry run: ``ninja: no work to do.`` when the ``.so`` is newer than the
    sources and headers it was made from, and was made by the same command lines). True without a
    ``build.ninja`` or when ninja cannot answer (cpp_extension then builds, or fails saying why)."""
    if not (out / "build.ninja").is_file():
        return True
    try:
        dry = subprocess.run(["ninja", "-n"], cwd=out, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError):
        return True
    return dry.returncode != 0 or "no work to do" not in dry.stdout


@contextlib.contextmanager
def _announcing_builds() -> Iterator[None]:
    """While it is entered, print :data:`NOTICE` on stderr just before cpp_extension runs ninja in a
    build directory where ninja has work (:func:`build_pending`), and the build's time after: by then cpp_extension has
    written the ``build.ninja`` of this build, so the answer is the build's own. (cpp_extension
    has no hook for it: its module-level ``_run_ninja_build`` is wrapped for the duration, under
    the build lock; a torch without that function gets the answer from the ``build.ninja`` a
    previous build left, before the load.)"""
    from torch.utils import cpp_extension

    real = getattr(cpp_extension, "_run_ninja_build", None)

    def run_ninja(build_directory: str, *args: object, **kwargs: object) -> None:
        if not build_pending(Path(build_directory)):
            return real(build_directory, *args, **kwargs)
        print(NOTICE.format(build_directory), file=sys.stderr, flush=True)
        start = time.perf_counter()
        real(build_directory, *args, **kwargs)
        print(f"built the MXFP8 native kernel in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)

    if real is None:
        yield
        return
    cpp_extension._run_ninja_build = run_ninja
    try:
        yield
    finally:
        cpp_extension._run_ninja_build = real


def _build(device: str) -> ModuleType:
    from torch.utils import cpp_extension

    name, src = _NAMES[device]
    out = build_dir(device)
    out.mkdir(parents=True, exist_ok=True)
    with open(str(out) + ".flock", "a+") as lock:
        deadline = time.monotonic() + _LOCK_TIMEOUT_S
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"waited {_LOCK_TIMEOUT_S:.0f} s for the build lock {out}.flock") from None
                time.sleep(0.2)
        try:
            stale = out / "lock"  # cpp_extension's baton; under our flock no live builder holds it
            if stale.exists():
                stale.unlink()
            if device == "cuda":
                flags = dict(extra_cflags=_CFLAGS, extra_cuda_cflags=["-O3"])
            else:
                openmp = _openmp_flags()
                flags = dict(extra_cflags=_CFLAGS + openmp, extra_ldflags=openmp)
            if getattr(cpp_extension, "_run_ninja_build", None) is None and build_pending(out):
                print(NOTICE.format(out), file=sys.stderr, flush=True)
            with _announcing_builds():
                return cpp_extension.load(
                    name=name, sources=[str(source_dir() / src)], build_directory=str(out), verbose=False, **flags
                )
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _openmp_flags() -> list[str]:
    """``-fopenmp`` where torch's intra-op threads are OpenMP ones: ``at::parallel_for`` is then a
    ``#pragma omp parallel`` inlined into the kernel, which runs on one thread unless the kernel is
    compiled with OpenMP (measured: rowwise 4096x1024 went from 8 to 16.6 GB/s with 2 threads).
    The module then links the ``libgomp.so.1`` torch has loaded already (same soname): one pool."""
    return ["-fopenmp"] if torch.backends.openmp.is_available() else []


def load(device: str = "cpu") -> ModuleType | None:
    """The compiled kernel module for ``device`` ("cpu" or "cuda"), building it on first use; None if
    it cannot be had (``unavailable_reason`` says why). Tried once per process and device."""
    if device in _modules:
        return _modules[device]
    module: ModuleType | None = None
    reason = _why_not(device)
    if reason is None:
        try:
            module = _build(device)
            rceil_table(device)
        except Exception as e:  # noqa: BLE001 - a build failure must never break the caller: it falls back
            module, reason = None, _first_line(e)
    _modules[device] = module
    if reason is not None:
        _reasons[device] = reason
    return module


def rceil_table(device: str = "cpu") -> torch.Tensor:
    """int32[256] on ``device``: for each float32 exponent field E of ``d = amax / max`` (1..254), the largest
    mantissa m for which float32 ``ceil(log2(d))`` still equals E - 127 (torch.log2 rounds
    log2(2^e · (1 + m·2^-23)) to e for small m); entry 0 is the same for subnormal d just above
    2^-127, counted from mantissa 2^22. Measured from ``torch.log2`` on that device (CPU and GPU
    log2 may round differently) once per process, and checked to be a threshold (every m up to it
    rounds down, every m above rounds up)."""
    if device in _tables:
        return _tables[device]
    span = 4096  # beyond ~100 ulps above 2^e, log2(d) - e exceeds any 1-ulp error of log2
    m = torch.arange(span, dtype=torch.int64)
    exps = torch.arange(256, dtype=torch.int64)
    bits = (exps[:, None] << 23) + m[None, :]
    bits[0] = (1 << 22) + m  # subnormals from 2^-127 up
    bits[255] = 0  # unused row (inf / NaN exponent field)
    d = bits.to(torch.int32).view(torch.float32)
    up = torch.ceil(torch.log2(d.to(device))).to(torch.int64).cpu()
    low = (exps - 127).clamp(min=-127)[:, None]
    down = up == low  # rounds to the power of two below (or is exactly it)
    table = torch.zeros(256, dtype=torch.int32)
    for e in range(255):
        row = down[e]
        n = int(row.long().cumprod(0).sum())  # leading run of True
        if n == 0 or bool(row[n:].any()) or bool((up[e, n:] != low[e] + 1).any()):
            raise RuntimeError(f"torch.log2 near 2^{e - 127} is not a clean threshold; rceil table unusable")
        table[e] = n - 1
    _tables[device] = table.to(device)
    return _tables[device]


def quantize(
    kernel: ModuleType, x: torch.Tensor, element: str, rule: str, axis: str, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run a loaded kernel on ``x`` for the MX format of ``element`` (``e4m3`` / ``e5m2``, stored
    as ``dtype``) and scale ``rule`` (``floor`` / ``rceil``); same contract as
    ``mfsdp_core.mx.quantize_reference`` (inputs checked there)."""
    thr = rceil_table(x.device.type)
    data, scale = kernel.quantize(x, 0 if element == "e4m3" else 1, 0 if rule == "floor" else 1, axis == "col", thr)
    return data.view(dtype), scale.view(torch.float8_e8m0fnu)
