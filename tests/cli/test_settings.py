"""The trainer's typed settings (``cli.settings``): one frozen value per run, in the sections of
``--help`` and of a ``--config`` file, made once by ``check_flags``; what the run starts from is a
value of its own (``StartPoint``), decided once, and the parsed flags are never rewritten."""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import subprocess
import sys

import pytest

from cli.settings import FRESH, SECTIONS, Settings, StartPoint, settings_of
from cli.train_args import build_parser, check_flags, parse_args

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_sections_are_the_flag_groups():
    """Each section holds exactly the flags ``--help`` lists under its name (and a ``--config``
    file sets in its ``[section]``); every flag is in one."""
    groups = {g.title: [a.dest for a in g._group_actions] for g in build_parser()._action_groups}
    for name, cls in SECTIONS.items():
        assert [f.name for f in dataclasses.fields(cls)] == groups[name], name
    assert [f.name for f in dataclasses.fields(Settings)] == [*SECTIONS, "config", "origin"]
    assert set(groups) - set(SECTIONS) == {"positional arguments", "options"}  # --help, --version, --config


def test_the_defaults_are_the_parsers():
    assert settings_of(parse_args([])) == Settings()


def test_the_settings_hold_every_flag_as_parsed():
    argv = ["--model", "tiny-moe", "--ep", "2", "--dtype", "bf16", "--optimizer", "muon", "--steps", "7"]
    argv += ["--ckpt-dir", "/tmp/x", "--resume", "--allow-change", "lr", "--allow-change", "seed", "--verbose"]
    args = parse_args(argv)
    settings = settings_of(args)
    assert settings.values() == {k: v for k, v in vars(args).items() if not k.startswith("_")}
    assert settings.parallelism.ep == 2 and settings.precision.param_dtype == "bfloat16"
    assert settings.checkpoint.allow_change == ("lr", "seed") and settings.logging.verbose


def test_the_settings_are_frozen():
    settings = settings_of(parse_args(["--resume", "auto", "--ckpt-dir", "/tmp/x"]))
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.checkpoint.resume = "/tmp/x/step_000001"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.model = settings.model  # type: ignore[misc]


def test_check_flags_validates_into_settings_and_leaves_the_flags_alone(tmp_path):
    args = parse_args(["--model", "tiny", "--ckpt-dir", str(tmp_path / "run"), "--save-every", "2"])
    before = dict(vars(args))
    settings = check_flags(args, 1)
    assert isinstance(settings, Settings) and settings.checkpoint.save_every == 2
    assert vars(args) == before


def test_a_refusal_names_where_a_value_came_from(tmp_path):
    """``Settings.shown``: the ``--config`` file that set a value is named, as before."""
    config = tmp_path / "run.toml"
    config.write_text("[training]\nbatch-size = 7\n")
    settings = settings_of(parse_args(["--config", str(config)]))
    assert settings.shown("batch_size", "--batch-size") == f"--batch-size 7 (set in {config})"
    assert settings_of(parse_args(["--batch-size", "7"])).shown("batch_size", "--batch-size") == "--batch-size 7"


def test_the_settings_import_no_torch():
    """The launcher makes the settings before any rank starts, without torch."""
    code = "import sys, cli.settings, cli.train_args; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr


def test_model_sources_build_from_the_seed_not_the_flags():
    """``ModelSource.build`` takes what it needs (the seed; Megatron-Core also the micro-batch
    count its auxiliary losses are scaled by), not the run's whole namespace."""
    from cli.hf_source import HFSource
    from cli.mcore_source import McoreSource
    from cli.model_base import ModelSource
    from cli.model_source import GPTSource

    for cls in (ModelSource, GPTSource, HFSource, McoreSource):
        assert list(inspect.signature(cls.build).parameters) == ["self", "seed", "mesh", "micro_batches"], cls
    from mfsdp_core.models.config import get_preset

    source = GPTSource(get_preset("tiny"), "tiny")
    one, two = source.build(3, None), source.build(3, None)
    assert all((a == b).all() for a, b in zip(one.parameters(), two.parameters()))


def test_the_recorded_run_config_keeps_its_keys():
    """What a checkpoint records (``run_config``), key for key: ``--resume`` compares it and takes
    its ``settings`` as defaults, so a renamed key would break resuming older checkpoints."""
    from cli.run_config import run_config

    recorded = run_config(settings_of(parse_args(["--optimizer", "muon", "--mxfp8"])), "tiny")
    assert json.loads(json.dumps(recorded)) == {
        "batch-size": 12,
        "clip": 1.0,
        "data": "synthetic",
        "dtype": "float32",
        "lr": 0.003,
        "micro-batches": 1,
        "min-lr": 0.0003,
        "muon-lr": 0.02,
        "mx-rule": "floor",
        "mxfp8": "e4m3",
        "ns-dtype": "bfloat16",
        "optimizer": "muon",
        "seed": 0,
        "seq-len": 64,
        "steps": 100,
        "warmup": 10,
        "weight-decay": 0.01,
        "settings": {
            "async_save": False,
            "batch_size": 12,
            "clip": 1.0,
            "comm_stream": False,
            "data": None,
            "data_dtype": "uint16",
            "keep": None,
            "log_every": 1,
            "lr": 0.003,
            "mem_every": 1,
            "mem_keep": 2,
            "mem_keep_on_exit": False,
            "mem_replicas": 1,
            "mem_tier": None,
            "metrics": None,
            "micro_batches": 1,
            "min_lr": 0.0003,
            "model_name": "tiny",
            "moe_aux_loss": "local",
            "muon_lr": 0.02,
            "mx_rule": "floor",
            "mxfp8": "e4m3",
            "ns_dtype": "bfloat16",
            "optimizer": "muon",
            "param_dtype": "float32",
            "policy": "even",
            "save_every": 0,
            "seed": 0,
            "seq_len": 64,
            "steps": 100,
            "strategy": "optim_grads_params",
            "tensorboard": None,
            "verbose": False,
            "warmup": 10,
            "weight_decay": 0.01,
        },
    }


def test_the_start_point_is_decided_once_and_the_flags_stay_as_given(tmp_path, capsys):
    """``--resume auto`` over a run directory: the checked checkpoint is a ``StartPoint``, and
    ``settings.checkpoint.resume`` still says ``auto`` (it used to become the sentinel, then the
    path); a directory without one starts fresh."""
    from cli.trainer import check_args, run, start_point

    ckpt_dir = str(tmp_path / "run")
    assert run(parse_args(["--model", "tiny", "--steps", "2", "--stop-at", "1", "--ckpt-dir", ckpt_dir])) == 0
    settings, source = check_args(parse_args(["--ckpt-dir", ckpt_dir, "--resume", "auto", "--steps", "2"]), 1)
    start = start_point(settings, source, 0)
    assert start == StartPoint("--resume", os.path.join(ckpt_dir, "step_000001")) and start.resumes
    assert settings.checkpoint.resume == "auto" and source.name == "tiny"
    empty = str(tmp_path / "empty")
    settings, source = check_args(parse_args(["--model", "tiny", "--ckpt-dir", empty, "--resume", "auto"]), 1)
    assert start_point(settings, source, 0) == FRESH and not FRESH.resumes
    assert f"--resume auto: no checkpoint in {empty}, starting fresh" in capsys.readouterr().out
