"""export-mcore's output loaded by the real ``megatron.core.dist_checkpointing.load`` (strict:
every key MCore asks for must be there), at world sizes 1 and 2, and MCore's logits on the
fixture batch compared with the ones it recorded when it wrote the fixture.

Runs MCore in this interpreter's environment, which ``make`` gives megatron-core (the ``mcore``
extra), so CI runs it; ``MFSDP_MCORE_PYTHON`` names another Python with megatron-core (e.g. one
with 0.19.2, fixtures/README.md). Without megatron-core there, the tests fail rather than skip."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from mfsdp_ckpt.mcore import export_mcore, import_mcore

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
FIXTURES = os.path.join(ROOT, "fixtures", "mcore")
PYTHON = os.environ.get("MFSDP_MCORE_PYTHON") or sys.executable

pytestmark = [pytest.mark.mcore_env, pytest.mark.heavy]

#: (fixture, world size, tp, pp, ep)
CASES = [
    ("dense", 1, 1, 1, 1),
    ("dense", 2, 2, 1, 1),
    ("moe_ep2", 1, 1, 1, 1),
    ("moe_ep2", 2, 1, 1, 2),
    ("pp2", 2, 1, 2, 1),
]


@pytest.mark.parametrize("name, world, tp, pp, ep", CASES)
def test_megatron_loads_export_mcore_output(name, world, tp, pp, ep, tmp_path):
    src = os.path.join(FIXTURES, name)
    import_mcore(src, tmp_path / "ckpt", world_size=3, config=src + ".config.json")  # MCore -> ours, 3 ranks
    export_mcore(tmp_path / "ckpt", tmp_path / "back")  # ours -> MCore
    torchrun = os.path.join(os.path.dirname(PYTHON), "torchrun")
    proc = subprocess.run(
        [
            torchrun,
            "--standalone",
            f"--nproc-per-node={world}",
            os.path.join(FIXTURES, "generate.py"),
            "--check-load",
            name,
            str(tmp_path / "back"),
            str(tp),
            str(pp),
            str(ep),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = re.findall(r"LOADED \S+ world \d+ tp \d+ pp \d+ ep \d+ rank (\d+)", proc.stdout)
    assert sorted(ranks) == [str(r) for r in range(world)], proc.stdout
    diffs = re.findall(r"max \|diff\| ([0-9.e+-]+?)(?=LOADED|\s|$)", proc.stdout)
    assert len(diffs) == (world if pp == 1 else 0) and all(float(d) <= 1e-5 for d in diffs), proc.stdout
