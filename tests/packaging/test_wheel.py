"""The wheel, installed as a user installs it (``tests/packaging/wheel_smoke.py``): built from this
checkout, installed into a fresh venv beside torch 2.13.0 (which pip keeps), every module imported
from the venv and none from the source tree, and the everyday commands run from a directory
outside the checkout: train on 2 ranks with saves, resume on 3, verify, reshard to 3, export to
and import from Hugging Face. (The test suite itself runs on an editable install, whose finder
serves packages from the checkout: a package the wheel lacked went unseen.) ``.ci/run`` runs the
same script on torch 2.14.1."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.packaging.wheel_smoke import ROOT

pytestmark = pytest.mark.heavy  # a venv with torch installed, a wheel built (about 90 s)


def test_the_wheel_installs_beside_torch_and_runs_outside_the_checkout(tmp_path):
    done = subprocess.run(
        [sys.executable, "tests/packaging/wheel_smoke.py", "--torch", "2.13.0", "--venv", str(tmp_path / "venv")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert done.stdout.strip().endswith("wheel smoke on torch 2.13.0: ok")
    imported = [
        line for line in done.stdout.splitlines() if line.endswith(" modules imported from the installed wheel")
    ]
    assert len(imported) == 1 and int(imported[0].split()[0]) >= 190, imported  # 196 today
