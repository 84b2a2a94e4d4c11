"""A report never replaces what the run holding its input keeps for itself (issue 65, cause 7):
``inspect RUN/step_2 --html RUN/latest`` replaced the run's ``latest`` pointer with the page (exit
0), and ``--resume`` of the run failed after. The pointer, the ``latest-checkpoint`` link and
every committed checkpoint of that run (the other steps included, not only the one read) are
refused as outputs, in one line, with the run byte-identical; a page beside the run stays allowed."""

from __future__ import annotations

import os
import shutil

import pytest
from click.testing import CliRunner

from cli.main import main
from tests.reliability.surroundings import digest
from tests.reliability.test_outputs_inside_inputs import saved_run  # noqa: F401 (fixture)


@pytest.fixture
def run(saved_run, tmp_path) -> str:  # noqa: F811
    copy = str(tmp_path / "run")
    shutil.copytree(saved_run, copy, symlinks=True)
    return copy


@pytest.mark.parametrize(
    "out",
    ["latest", "latest-checkpoint", "step_1/mfsdp.json", "step_1/__0_0.distcp", "step_1/new.html"],
)
def test_a_report_never_replaces_the_runs_pointer_or_another_committed_checkpoint(run, tmp_path, out):
    before = digest(tmp_path)
    target = os.path.join(run, out)
    done = CliRunner().invoke(main, ["inspect", os.path.join(run, "step_2"), "--html", target])
    assert done.exit_code == 1, done.output
    lines = done.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: --html {target}: "), lines
    assert digest(tmp_path) == before


def test_a_report_beside_the_run_is_written(run, tmp_path):
    page = os.path.join(run, "report.html")
    done = CliRunner().invoke(main, ["inspect", os.path.join(run, "step_2"), "--html", page])
    assert done.exit_code == 0 and os.path.getsize(page) > 0, done.output
