"""The package as a user meets it: built into a wheel, installed into a fresh virtual environment
beside a given torch, and run from a directory outside the checkout.

    python tests/packaging/wheel_smoke.py --torch 2.14.1 --venv .venv-torch2.14

1. builds the sdist and, from it, the wheel (``python -m build``; ``--wheel`` gives one instead);
2. creates ``--venv`` (unless it exists) and installs ``torch==VERSION`` first, then the wheel:
   pip must keep that torch (the dependency range admits it);
3. from a new directory outside the checkout, with no ``PYTHONPATH``: imports every module of the
   installed packages (each from the venv, none from the source tree), trains the reference GPT
   on 2 ranks with saves, resumes on 3, verifies, reshards to 3 ranks, exports to Hugging Face
   safetensors and imports that back, and verifies the result.

Each command's output is printed; the first failure exits 1 with one line saying which.
"""

from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: imports every module of the installed packages; prints how many, and fails on one that does
#: not import or that comes from anywhere but the venv's site-packages (the checkout, say: the venv
#: itself may live inside the checkout, so the test is where a module is, not where it is not)
IMPORT_ALL = """
import importlib, os, pkgutil, sys, sysconfig
paths = sysconfig.get_paths()
installed = {os.path.realpath(paths[key]) + os.sep for key in ("purelib", "platlib")}
n, bad = 0, []
for top in ("mfsdp_core", "mfsdp_ckpt", "mfsdp_cli"):
    package = importlib.import_module(top)
    for info in [None, *pkgutil.walk_packages(package.__path__, top + ".")]:
        name = top if info is None else info.name
        n += 1
        try:
            module = importlib.import_module(name)
        except Exception as e:
            bad.append(f"{name}: {type(e).__name__}: {e}")
            continue
        where = os.path.realpath(module.__file__)
        if not any(where.startswith(prefix) for prefix in installed):
            bad.append(f"{name}: imported from outside the venv's site-packages ({where})")
print(f"{n} modules imported from the installed wheel" if not bad else "\\n".join(bad))
sys.exit(1 if bad else 0)
"""


class SmokeFailure(Exception):
    """A step of the smoke run failed (the message says which)."""


def run(cmd: list[str], cwd: str, env: dict[str, str]) -> str:
    """Run ``cmd``, echo its output, and return stdout; a non-zero exit is a :class:`SmokeFailure`."""
    print(f"$ {' '.join(cmd)}", flush=True)
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    sys.stdout.write(done.stdout + done.stderr)
    sys.stdout.flush()
    if done.returncode != 0:
        raise SmokeFailure(f"{' '.join(cmd[:3])}... exited with {done.returncode}")
    return done.stdout


def build_wheel(out: str) -> str:
    """The wheel of this checkout, built into ``out`` as ``python -m build`` builds it by default:
    the sdist first, then the wheel from the unpacked sdist (so the sdist is shown to hold what
    the wheel needs, and nothing is built inside the checkout)."""
    run([sys.executable, "-m", "build", "--outdir", out, ROOT], ROOT, dict(os.environ))
    (wheel,) = glob.glob(os.path.join(out, "mfsdp_ckpt-*.whl"))
    return wheel


def install(venv: str, torch_version: str, wheel: str) -> None:
    """A venv with ``torch==torch_version`` installed first, then ``wheel``; the torch kept."""
    env = _clean_env()
    if not os.path.exists(os.path.join(venv, "bin", "python")):
        run([sys.executable, "-m", "venv", venv], ROOT, env)
    python = os.path.join(venv, "bin", "python")
    run([python, "-m", "pip", "install", "--quiet", f"torch=={torch_version}"], ROOT, env)
    run([python, "-m", "pip", "install", "--quiet", "--force-reinstall", "--no-deps", wheel], ROOT, env)
    run([python, "-m", "pip", "install", "--quiet", wheel], ROOT, env)  # its dependencies, torch kept
    got = run([python, "-c", "import torch; print(torch.__version__)"], ROOT, env).strip()
    if got.split("+")[0] != torch_version:
        raise SmokeFailure(f"installing the wheel changed torch from {torch_version} to {got}")


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["OMP_NUM_THREADS"] = "1"
    return env


def tour(venv: str, work: str) -> None:
    """The user's commands in ``work`` (outside the checkout) with the venv's executables."""
    bin_dir = os.path.join(venv, "bin")
    env = _clean_env()
    env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
    python, train, ckpt = (os.path.join(bin_dir, name) for name in ("python", "mfsdp-train", "mfsdp-ckpt"))
    run([python, "-c", IMPORT_ALL], work, env)
    common = ["--model", "tiny", "--steps", "6", "--batch-size", "6", "--seq-len", "32", "--log-every", "2"]
    run(
        [train, "--nproc-per-node", "2", *common, "--stop-at", "4", "--save-every", "2", "--ckpt-dir", "run"], work, env
    )
    resumed = run([train, "--nproc-per-node", "3", "--ckpt-dir", "run", "--resume"], work, env)
    if "resumed from" not in resumed or "finished: step 6 of 6" not in resumed:
        raise SmokeFailure("the resume on 3 ranks did not continue the run to step 6")
    run([ckpt, "verify", "run/latest"], work, env)
    run([ckpt, "reshard", "run/latest", "w3", "--world-size", "3"], work, env)
    run([ckpt, "verify", "w3"], work, env)
    run([ckpt, "export-hf", "run/latest", "hf"], work, env)
    run([ckpt, "import-hf", "hf", "back"], work, env)
    run([ckpt, "verify", "back"], work, env)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--torch", required=True, help="the torch release to install first (e.g. 2.14.1)")
    p.add_argument("--venv", required=True, help="the virtual environment to use (created if missing)")
    p.add_argument("--wheel", default=None, help="a built wheel (default: build one from this checkout)")
    args = p.parse_args(argv)
    try:
        with tempfile.TemporaryDirectory(prefix="mfsdp-wheel-") as tmp:
            wheel = args.wheel or build_wheel(os.path.join(tmp, "dist"))
            install(os.path.abspath(args.venv), args.torch, wheel)
            work = os.path.join(tmp, "work")
            os.makedirs(work)
            tour(os.path.abspath(args.venv), work)
    except SmokeFailure as e:
        print(f"wheel smoke on torch {args.torch}: FAILED: {e}", flush=True)
        return 1
    print(f"wheel smoke on torch {args.torch}: ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
