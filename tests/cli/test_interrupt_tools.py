"""Ctrl-C of every offline ``mfsdp-ckpt`` tool, at several moments of its work, is one line
``error: interrupted``, exit code 130, and nothing at the destination (no directory or file, no
staging ``.partial-`` leftovers): just after the staging directory is made (before its writer has
taken charge of it: it used to stay behind), inside ``torch.save``'s writes of a data file (or a
safetensors file's positional writes), a few writes later, and just before the staged output is
renamed into place. The moments are hit deterministically (``tests/cli/interrupt_at.py`` sends
the SIGINT to the process group from inside them). Inside ``torch.save`` the interrupt used to surface as
``RuntimeError: [enforce fail at inline_container.cc:672] ... unexpected pos``, exit 1.

Just after that rename the output is committed: a Ctrl-C then is no failure, the command says
what it wrote and exits 0 (it used to say ``error: interrupted``, exit 130, and leave the
complete output behind, which a rerun then refused as existing)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

pytest.importorskip("transformers")

from cli.main import main
from tests.cli.interrupt_at import INTERRUPT_ENV
from tests.mfsdp_ckpt.hf.util import hf_config, random_hf_model, save_hf
from tests.torchrun import start_in_own_session

ROOT = Path(__file__).resolve().parent.parent.parent

#: case -> (command, source in the ``sources`` fixture, destination name, extra arguments, moments that apply)
WRITES, COMMIT = ("write:1", "write:3"), ("commit",)
STAGED = ("staged",)  # the staging directory made, not yet in its writer's charge: it used to stay behind
TOOLS = {
    "reshard": ("reshard", "ckpt", "dst", ("--world-size", "1", "--workers", "1"), STAGED + WRITES + COMMIT),
    "export-hf": ("export-hf", "ckpt", "dst", (), STAGED + WRITES + COMMIT),
    "import-hf": ("import-hf", "hf", "dst", (), STAGED + WRITES + COMMIT),
    "export-mcore": ("export-mcore", "ckpt", "dst", (), STAGED + WRITES + COMMIT),
    "import-mcore": ("import-mcore", "mc", "dst", ("--world-size", "1"), STAGED + WRITES + COMMIT),
    "convert-dcp-fsdp2": ("convert", "ckpt", "dst", ("--to", "dcp-fsdp2"), STAGED + WRITES + COMMIT),
    "convert-dcp": ("convert", "safetensors", "dst", ("--to", "dcp"), STAGED + WRITES + COMMIT),
    # the file is made in memory and written at once: only the commit is a moment of its own
    "convert-safetensors": ("convert", "ckpt", "dst.safetensors", ("--to", "safetensors"), COMMIT),
    "upcycle": ("upcycle", "ckpt", "dst", ("--num-experts", "2", "--topk", "1"), STAGED + WRITES + COMMIT),
}
CASES = [(tool, moment) for tool, (*_, moments) in TOOLS.items() for moment in moments]


def _case(tool: str, moment: str) -> object:
    """Every tool inside its 3rd write (its only moment, the commit, for one-write tools) and
    reshard at every moment run always; the rest of the matrix is heavy (about 3 s a case)."""
    core = tool == "reshard" or moment == WRITES[-1] or TOOLS[tool][4] == COMMIT
    return pytest.param(tool, moment, id=f"{tool}-{moment}", marks=() if core else pytest.mark.heavy)


def _invoke(*args: str) -> None:
    result = CliRunner().invoke(main, list(args))
    assert result.exit_code == 0, (args, result.output, result.exception)


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A Qwen3 Hugging Face directory (4 layers, hidden 256: 6.6 MiB, dozens of tensors, so that
    every tool writes many times), the checkpoint imported from it and its MCore export."""
    tmp = tmp_path_factory.mktemp("interrupt_sources")
    config = hf_config("qwen3", hidden_size=256, intermediate_size=512, num_hidden_layers=4)
    hf = save_hf(random_hf_model(config), str(tmp / "hf"))
    out = {"hf": hf, "safetensors": os.path.join(hf, "model.safetensors"), "ckpt": str(tmp / "ckpt")}
    _invoke("import-hf", hf, out["ckpt"])
    out["mc"] = str(tmp / "mc")
    _invoke("export-mcore", out["ckpt"], out["mc"])
    return out


@pytest.mark.parametrize(("tool", "moment"), [_case(t, m) for t, m in CASES])
def test_ctrl_c_leaves_nothing(sources: dict[str, str], tmp_path: Path, tool: str, moment: str) -> None:
    command, source, name, extra, _ = TOOLS[tool]
    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, PYTHONPATH=str(ROOT), **{INTERRUPT_ENV: moment})
    args = [command, sources[source], str(out / name), *extra]
    proc = start_in_own_session([sys.executable, "-m", "tests.cli.interrupt_at", *args], ROOT, env)
    stdout, stderr = proc.communicate(timeout=300)
    assert (proc.returncode, stderr, stdout) == (130, "error: interrupted\n", ""), (args, moment, stderr[-3000:])
    assert sorted(os.listdir(out)) == [], [(r, d, f) for r, d, f in os.walk(out)]


#: tools whose ``committed`` case runs always; the others' are heavy (about 3 s a case)
COMMITTED_CORE = ("reshard", "export-hf", "convert-safetensors")


@pytest.mark.parametrize(
    "tool", [pytest.param(t, marks=() if t in COMMITTED_CORE else pytest.mark.heavy) for t in TOOLS]
)
def test_ctrl_c_after_the_commit_reports_the_output_written(sources: dict[str, str], tmp_path: Path, tool: str) -> None:
    command, source, name, extra, _ = TOOLS[tool]
    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, PYTHONPATH=str(ROOT), **{INTERRUPT_ENV: "committed"})
    args = [command, sources[source], str(out / name), *extra]
    proc = start_in_own_session([sys.executable, "-m", "tests.cli.interrupt_at", *args], ROOT, env)
    stdout, stderr = proc.communicate(timeout=300)
    notes = [line for line in stderr.splitlines() if not line.startswith("note: ")]  # import-mcore's
    assert (proc.returncode, notes) == (0, []), (args, proc.returncode, stderr[-3000:])
    assert stdout.startswith(f"wrote {out / name}"), stdout
    assert sorted(os.listdir(out)) == [name]
    if name == "dst" and command != "export-hf":
        from mfsdp_ckpt.tools import verify_checkpoint

        assert not verify_checkpoint(str(out / name))


def test_an_interrupt_at_write_n_is_reached(sources: dict[str, str], tmp_path: Path) -> None:
    """The hook's moments come: without it the same reshard finishes (exit 0), and ``write:N``
    of a moment past its last write lets it finish too (so a 130 above is the hook's doing)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), **{INTERRUPT_ENV: "write:100000"})
    args = ["reshard", sources["ckpt"], str(tmp_path / "dst"), "--world-size", "1", "--workers", "1"]
    done = subprocess.run(
        [sys.executable, "-m", "tests.cli.interrupt_at", *args], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0 and (tmp_path / "dst").is_dir(), done.stderr
