"""Ctrl-C at a random moment of every writing command is all or nothing: either the command
committed its output (exit 0, ``wrote ...`` on stdout, the output verifies), even when the SIGINT
came after the commit, or it did not (exit 130, ``error: interrupted`` and nothing else, no
destination and no staging sibling left). Never another exit code, never a traceback.

Each command runs once without an interrupt first; that run records (``tests/cli/interrupt_at.py``,
``timeline:``) when its staged output was renamed into place, and the interrupted runs send
SIGINT to the process group (as Ctrl-C does) at random moments over the whole run and, most of
them, within a moment of that commit. Before the fix, a SIGINT just after the rename was reported
as ``error: interrupted`` (130) with a complete output left behind (users saw it in 3 of 8 tries
of a 470 MiB reshard; ``test_interrupt_tools.py``'s ``committed`` moment hits it every time), and
one after the command's last line killed the process by the signal (exit status -2: 5 of 24
such tries). Reshard gets 20 tries, the other seven commands 3 each. The moments start after the interpreter's own start-up (the first few hundredths of a
second, before ``mfsdp-ckpt``'s code runs, are Python's)."""

from __future__ import annotations

import os
import random
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from click.testing import CliRunner

from cli.main import main
from tests.cli.interrupt_at import INTERRUPT_ENV
from tests.torchrun import start_in_own_session

ROOT = Path(__file__).resolve().parent.parent.parent
DENSE = ROOT / "fixtures" / "mcore" / "dense"

#: case -> (command, source in ``sources``, destination name, extra arguments, how to check a committed output)
CASES = {
    "reshard": ("reshard", "ckpt", "dst", ("--world-size", "2", "--workers", "1"), "checkpoint"),
    "convert-fsdp2": ("convert", "ckpt", "dst", ("--to", "dcp-fsdp2"), "checkpoint"),
    "convert-safetensors": ("convert", "ckpt", "dst.safetensors", ("--to", "safetensors"), "safetensors"),
    "export-hf": ("export-hf", "ckpt", "dst", (), "hf"),
    "import-hf": ("import-hf", "hf", "dst", (), "checkpoint"),
    "export-mcore": ("export-mcore", "ckpt", "dst", (), "checkpoint"),
    "import-mcore": ("import-mcore", "mc", "dst", ("--config", f"{DENSE}.config.json"), "checkpoint"),
    "upcycle": ("upcycle", "ckpt", "dst", ("--num-experts", "2", "--topk", "1"), "checkpoint"),
}
AROUND_COMMIT, OVER_THE_RUN = 2, 1  # interrupted tries per case ...
TRIES = {"reshard": (10, 10)}  # ... but reshard's: 20 of the 41 tries
EARLIEST = 0.5  # seconds: well after the interpreter's own start-up (some 0.05 s; more on a busy machine)


def _invoke(*args: str) -> None:
    result = CliRunner().invoke(main, list(args))
    assert result.exit_code == 0, (args, result.output, result.exception)


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A small GPT checkpoint imported from the Megatron-Core fixture, its HF export, and the
    fixture itself (together some 300 KiB)."""
    tmp = tmp_path_factory.mktemp("commit_sources")
    out = {"mc": str(DENSE), "ckpt": str(tmp / "ckpt"), "hf": str(tmp / "hf")}
    _invoke("import-mcore", out["mc"], out["ckpt"], "--config", f"{DENSE}.config.json")
    _invoke("export-hf", out["ckpt"], out["hf"])
    return out


def _run(case: str, sources: dict[str, str], out: Path, delay: float | None) -> dict:
    """One run of ``case`` writing into the empty directory ``out``: SIGINT to its process group
    ``delay`` seconds after its start (None: none, its timeline recorded); what came of it."""
    command, source, name, extra, _ = CASES[case]
    out.mkdir()
    timeline = out.parent / f"{out.name}.timeline"
    env = dict(os.environ, PYTHONPATH=str(ROOT), **{INTERRUPT_ENV: f"timeline:{timeline}"})
    args = [command, sources[source], str(out / name), *extra]
    start = time.monotonic()
    proc = start_in_own_session([sys.executable, "-m", "tests.cli.interrupt_at", *args], ROOT, env)
    if delay is not None:
        time.sleep(max(0.0, start + delay - time.monotonic()))
        try:
            os.killpg(proc.pid, signal.SIGINT)
        except ProcessLookupError:
            pass  # already gone: the run is a plain one
    stdout, stderr = proc.communicate(timeout=300)
    end = time.monotonic()
    moments = [line.split() for line in timeline.read_text().splitlines()] if timeline.exists() else []
    commits = [float(t) - start for n, t in moments if n == "commit"]
    return {
        "case": case,
        "delay": delay,
        "code": proc.returncode,
        "stdout": stdout,
        "stderr": stderr,
        "left": sorted(os.listdir(out)),
        "dst": out / name,
        "commit": max(commits) if commits else None,
        "end": end - start,
    }


def _verified(kind: str, path: Path) -> bool:
    """Whether the committed output at ``path`` is complete: a checkpoint that ``verify`` passes,
    an HF directory or a safetensors file whose tensors all read."""
    if kind == "checkpoint":
        from mfsdp_ckpt.tools import verify_checkpoint

        return path.is_dir() and not verify_checkpoint(str(path))
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors")) if kind == "hf" else [path]
    if kind == "hf" and not (path / "config.json").is_file():
        return False
    return bool(files) and all(load_file(str(f)) for f in files)


def _problem(run: dict) -> str | None:
    """What breaks the all-or-nothing contract in one run (see the module docstring); None: nothing."""
    if run["code"] == 130:
        if run["stderr"] != "error: interrupted\n" or run["stdout"]:
            return "exit 130 with other output"
        if run["left"]:
            return f"exit 130 and left {run['left']}"  # no destination, no .<name>.partial-*, no lock file
        return None
    if run["code"] != 0:
        return f"exit code {run['code']}"
    if "Traceback" in run["stderr"] or "error" in run["stderr"]:
        return "exit 0 with an error"
    if not run["stdout"].startswith(f"wrote {run['dst']}") or run["left"] != [run["dst"].name]:
        return f"exit 0 without saying so or with {run['left']} left"
    if not _verified(CASES[run["case"]][4], run["dst"]):
        return "exit 0 and an output that does not verify"
    return None


@pytest.mark.heavy  # 49 runs of the commands, two at a time (about 70 s)
def test_a_ctrl_c_at_any_moment_commits_all_or_nothing(sources: dict[str, str], tmp_path: Path) -> None:
    rng = random.Random(os.environ.get("MFSDP_TEST_SEED", "commit"))
    counter = iter(range(10**6))

    def run(case: str, delay: float | None) -> dict:
        return _run(case, sources, tmp_path / f"{case}-{next(counter)}", delay)

    with ThreadPoolExecutor(2) as pool:  # two at a time: the machine has two cores
        plain = list(pool.map(lambda case: run(case, None), CASES))
        for r in plain:
            assert _problem(r) is None and r["code"] == 0 and r["commit"] is not None, r
        tries = []
        for r in plain:
            around, over = TRIES.get(r["case"], (AROUND_COMMIT, OVER_THE_RUN))
            tries += [(r["case"], r["commit"] + rng.uniform(-0.08, 0.08)) for _ in range(around)]
            tries += [(r["case"], rng.uniform(EARLIEST, r["end"] + 0.05)) for _ in range(over)]
        runs = list(pool.map(lambda t: run(*t), tries))
    bad = [(_problem(r), r) for r in runs if _problem(r) is not None]
    assert not bad, "\n".join(f"{p}: {r}" for p, r in bad)
    codes = sorted(r["code"] for r in runs)
    assert len(runs) >= 20 and 130 in codes, codes  # the interrupts did land
    reshards = sorted(r["code"] for r in runs if r["case"] == "reshard")
    assert len(reshards) == 20 and 130 in reshards, reshards


@pytest.mark.parametrize("command", ["reshard", "verify"])
def test_a_ctrl_c_after_the_last_line_changes_nothing(sources: dict[str, str], tmp_path: Path, command: str) -> None:
    """A Ctrl-C that comes once the command has said what it did (while the process ends) leaves
    its exit code 0 and adds nothing. It used to kill the process by the signal in most tries
    (exit status -2: the interpreter's shutdown gives SIGINT its default action back), or print a
    traceback of torch's exit handlers."""

    def run(i: int) -> tuple[int, str]:
        out = tmp_path / f"out-{i}"
        out.mkdir()
        args = [command, sources["ckpt"], *([str(out / "dst"), "--world-size", "2"] if command == "reshard" else [])]
        proc = start_in_own_session([sys.executable, "-m", "cli.main", *args], ROOT, dict(os.environ))
        assert proc.stdout is not None and proc.stdout.readline()  # its first line: the work is done
        time.sleep(0.004 * i)
        os.killpg(proc.pid, signal.SIGINT)
        _, stderr = proc.communicate(timeout=300)
        return proc.returncode, stderr

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(run, range(4)))
    assert results == [(0, "")] * 4, results
