"""The native MXFP8 kernel's build is announced whenever one runs, a stale ``.so`` in the cache
included (a source or the flags changed since it was made), and only then: the decision is ninja's
own (``mx_native.build_pending``: ``ninja -n``), asked just before cpp_extension runs ninja. Staged
build directories with a one-rule ``build.ninja`` (a copy instead of a compiler) stand for the
cache: the same ninja decides, in milliseconds instead of a one-minute build."""

from __future__ import annotations

import os
import re
import subprocess
import types

import pytest
from torch.utils import cpp_extension

from mfsdp_core import mx_native

pytestmark = pytest.mark.skipif(not cpp_extension.is_ninja_available(), reason="no ninja (cpp_extension needs it)")

LIB = "mfsdp_mx_cast.so"


def _stage(out, command: str = "cp src.cpp $out") -> None:
    """A build directory whose ``build.ninja`` makes ``LIB`` from ``src.cpp`` with ``command``."""
    out.mkdir(parents=True, exist_ok=True)
    if not (out / "src.cpp").exists():
        (out / "src.cpp").write_text("int answer = 42;\n")
    (out / "build.ninja").write_text(f"rule link\n  command = {command}\nbuild {LIB}: link src.cpp\ndefault {LIB}\n")


def _ninja(out) -> None:
    subprocess.run(["ninja"], cwd=out, check=True, capture_output=True)


def _said(capsys) -> list[str]:
    """The lines on stderr, the build's seconds as N."""
    return [re.sub(r" in \d+ s$", " in N s", line) for line in capsys.readouterr().err.splitlines()]


def _make_stale(out) -> None:
    """The library older than its source, as a .so left from before the source changed."""
    os.utime(out / LIB, (1_000_000_000, 1_000_000_000))


def test_build_pending_is_ninjas_decision(tmp_path):
    out = tmp_path / "ext"
    assert mx_native.build_pending(out)  # no build.ninja: nothing was ever built here
    _stage(out)
    assert mx_native.build_pending(out)  # no library yet
    _ninja(out)
    assert not mx_native.build_pending(out)  # up to date: a load, no build
    _make_stale(out)
    assert mx_native.build_pending(out)  # a .so exists, but is stale: today's notice said nothing here
    _ninja(out)
    assert not mx_native.build_pending(out)
    _stage(out, "cp -p src.cpp $out")  # other flags, same files: ninja rebuilds
    assert mx_native.build_pending(out)


def test_notice_when_ninja_is_about_to_build_and_not_otherwise(tmp_path, capsys):
    out = tmp_path / "ext"
    _stage(out)
    _ninja(out)
    real = cpp_extension._run_ninja_build
    with mx_native._announcing_builds():
        cpp_extension._run_ninja_build(str(out), False, error_prefix="x")
    assert capsys.readouterr().err == ""  # up to date: loaded without a word
    _make_stale(out)
    with mx_native._announcing_builds():
        cpp_extension._run_ninja_build(str(out), False, error_prefix="x")
    assert _said(capsys) == [mx_native.NOTICE.format(out), "built the MXFP8 native kernel in N s"]
    assert not mx_native.build_pending(out)  # ninja did build
    assert cpp_extension._run_ninja_build is real  # unwrapped again


def test_build_with_a_stale_so_in_the_cache_says_so(tmp_path, monkeypatch, capsys):
    """``mx_native``'s own build path (lock, cpp_extension.load) with a stale ``.so`` in the cache
    under ``TORCH_EXTENSIONS_DIR``: cpp_extension.load stands in for the compiler by running ninja
    on the staged build directory as the real one does."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    out = mx_native.build_dir("cpu")
    _stage(out)
    _ninja(out)
    _make_stale(out)
    module = types.ModuleType("mfsdp_mx_cast")

    def load(name, sources, build_directory, verbose, **flags):
        cpp_extension._run_ninja_build(build_directory, verbose, error_prefix=f"Error building extension '{name}'")
        return module

    monkeypatch.setattr(cpp_extension, "load", load)
    assert mx_native._build("cpu") is module
    assert _said(capsys) == [mx_native.NOTICE.format(out), "built the MXFP8 native kernel in N s"]
    assert mx_native._build("cpu") is module  # built now: no second notice
    assert capsys.readouterr().err == ""
