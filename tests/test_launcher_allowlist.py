"""The trainer starts as a process of its own (torchrun, our launcher, ``python -m cli.train``)
only in the launcher tests that :data:`tests.torchrun.LAUNCHER_TESTS` lists; every other trainer
test runs it on the harness's warm ranks (``run_train``). ``train_cmd`` refuses a caller outside
the list at run time; this test holds the list to the files that start a trainer process by any
spelling, in both directions, so that it neither misses one nor keeps a file that no longer does."""

from __future__ import annotations

import os
import re

import pytest

from tests.torchrun import LAUNCHER_TESTS, ROOT, _check_launcher_test, train_cmd

#: the spellings of starting the trainer as a process: our helper, a forced launcher run, our
#: launcher through run_train, torchrun itself, the trainer's module run by an interpreter
STARTS_A_TRAINER = re.compile(
    r"train_cmd\(|launcher=True|run_train\(None, \"--nproc-per-node\"|torch\.distributed\.run|"
    r"\"-m\",\s*\"(?:mfsdp_)?cli\.train\""
)
#: the helpers that implement the two ways (not tests), and this file (it calls train_cmd)
HELPERS = {
    "tests/torchrun.py",
    "tests/warm_train.py",
    "tests/packaging/wheel_smoke.py",
    "tests/test_launcher_allowlist.py",
}


def _test_files() -> list[str]:
    out = []
    for folder, _, names in os.walk(os.path.join(ROOT, "tests")):
        for name in names:
            if name.endswith(".py"):
                out.append(os.path.relpath(os.path.join(folder, name), ROOT).replace(os.sep, "/"))
    return sorted(out)


def _starts_a_trainer(path: str) -> bool:
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return STARTS_A_TRAINER.search(f.read()) is not None


def test_the_allow_list_is_exactly_the_files_that_start_a_trainer_process():
    starting = {path for path in _test_files() if path not in HELPERS and _starts_a_trainer(path)}
    assert starting - LAUNCHER_TESTS == set(), "start the trainer outside LAUNCHER_TESTS"
    assert LAUNCHER_TESTS - starting == {"tests/test_launcher_allowlist.py"}, "listed, yet start no trainer process"
    assert len(LAUNCHER_TESTS) <= 20, sorted(LAUNCHER_TESTS)  # the launcher tests stay a few


def test_a_test_outside_the_list_may_not_start_a_trainer_process(monkeypatch):
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "tests/cli/test_somewhere.py::test_x (call)")
    with pytest.raises(AssertionError, match=r"tests/cli/test_somewhere.py starts the trainer as a process"):
        train_cmd(2, "--steps", "1")
    monkeypatch.setenv("PYTEST_CURRENT_TEST", f"{sorted(LAUNCHER_TESTS)[0]}::test_x (call)")
    _check_launcher_test()
    assert train_cmd(None, "--steps", "1")[-3:] == ["cli.train", "--steps", "1"]
