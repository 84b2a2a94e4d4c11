"""Hostile Megatron-Core arguments: ``import-mcore --config`` / ``export-hf --mcore-config`` files,
the ``args`` an MCore checkpoint's ``common.pt`` carries, ``mfsdp-train --mcore-config`` files and
a checkpoint's recorded ``model_source.args`` all pass one check
(:func:`mfsdp_ckpt.mcore.config_check.check_mcore_config`) before anything is built or written.

Each case asserts: one ``error:`` line naming the file (or flag) and the argument, exit 1, nothing
at the destination, no input changed. The import cases run in this process (click's CliRunner, a
few milliseconds each) under an address-space cap of what the process holds + 1 GiB, so a value
that made the import allocate what it asks for fails the case instead of the machine. The source
is the small MCore fixture ``fixtures/mcore/dense`` (written by megatron-core 0.16.1)."""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import random
import resource
import shutil
import subprocess
import sys
import textwrap
from typing import Any, Iterator

import pytest
import torch
from click.testing import CliRunner

from cli.main import main
from mfsdp_ckpt.errors import ConversionError
from tests.reliability.test_hostile_support import ROOT

FIXTURES = os.path.join(ROOT, "fixtures", "mcore")
DENSE = os.path.join(FIXTURES, "dense")
with open(os.path.join(FIXTURES, "dense.config.json")) as _f:
    ARGS: dict[str, Any] = json.load(_f)  # the fixture's own arguments: valid
GIB = 1 << 30


def _digest(path: str) -> dict[str, str]:
    """Every file under ``path`` (or ``path`` itself) by its sha256: what "no input changed" compares."""
    if os.path.isfile(path):
        with open(path, "rb") as f:
            return {path: hashlib.sha256(f.read()).hexdigest()}
    out = {}
    for d, _, files in os.walk(path):
        for name in files:
            out.update(_digest(os.path.join(d, name)))
    return out


@contextlib.contextmanager
def address_cap(extra: int = GIB) -> Iterator[None]:
    """This process's address space capped (soft limit) at what it maps now + ``extra`` while the
    block runs: an import that allocates what a hostile value asks fails instead of swapping."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/statm") as f:
        mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    cap = mapped + extra
    if hard != resource.RLIM_INFINITY and cap > hard:
        cap = hard
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _write_config(tmp_path, content: Any, name: str = "args.json") -> str:
    """A config file holding ``content`` (a dict or list: JSON as ``json.dumps`` writes it, NaN and
    Infinity included; a str: raw text)."""
    path = tmp_path / name
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(path)


def _refused(command: list[str], inputs: list[str], dest: str, *fragments: str) -> str:
    """Run ``mfsdp-ckpt COMMAND`` in this process under the address cap and assert the refusal
    (one ``error:`` line holding every fragment, exit 1, nothing at ``dest`` nor beside it, every
    input unchanged); returns the line."""
    before = {p: _digest(p) for p in inputs}
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    with address_cap():
        result = CliRunner().invoke(main, command)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == 1, (result.exit_code, result.output)
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "internal error" not in lines[0] and "Traceback" not in result.output, result.output
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    assert os.listdir(os.path.dirname(dest)) == [], os.listdir(os.path.dirname(dest))
    assert {p: _digest(p) for p in inputs} == before
    return lines[0]


def _import_refused(tmp_path, content: Any, *fragments: str) -> str:
    config = _write_config(tmp_path, content)
    dest = str(tmp_path / "out" / "ckpt")
    return _refused(["import-mcore", DENSE, dest, "--config", config], [DENSE, config], dest, config, *fragments)


# ---- the cases, and the "internal error" ones ------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value, says",
    [
        ("rotary_base", math.nan, "rotary_base=nan: expected a finite number"),
        ("norm_epsilon", -1, "norm_epsilon=-1: expected a finite number in (0, 1)"),
        ("kv_channels", "16", "kv_channels='16': expected an integer"),  # was "TypeError ... an internal error"
        ("seq_length", 10**30, "seq_length=1000000000000000000000000000000: expected an integer in [1, "),
        ("num_attention_heads", True, "num_attention_heads=True: expected an integer"),
    ],
    ids=["rotary_base-nan", "norm_epsilon-negative", "kv_channels-string", "seq_length-huge", "heads-bool"],
)
def test_import_mcore_refuses_an_argument_no_model_runs_with(field, value, says, tmp_path):
    _import_refused(tmp_path, {**ARGS, field: value}, says)


def test_import_mcore_refuses_nested_junk_in_one_line(tmp_path):
    """Nesting deeper than the JSON parser recurses: was "RecursionError ... an internal error"."""
    _import_refused(tmp_path, '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}", "not JSON (nested too deeply)")


def test_import_mcore_refuses_hostile_args_in_the_checkpoints_common_state(tmp_path):
    """Megatron-LM's ``args`` in ``common.pt`` pass the same check, named as that file's."""
    src = str(tmp_path / "src")
    shutil.copytree(DENSE, src)
    args = argparse.Namespace(**{**ARGS, "norm_epsilon": math.inf})
    torch.save({"iteration": 7, "args": args}, os.path.join(src, "common.pt"))
    dest = str(tmp_path / "out" / "ckpt")
    _refused(["import-mcore", src, dest], [src], dest, f"{src}/common.pt 'args': norm_epsilon=inf")


def test_export_hf_refuses_a_hostile_mcore_config(tmp_path):
    config = _write_config(tmp_path, {**ARGS, "rotary_base": -math.inf})
    dest = str(tmp_path / "out" / "hf")
    _refused(["export-hf", DENSE, dest, "--mcore-config", config], [DENSE, config], dest, config, "rotary_base=-inf")


# ---- a seeded fuzz of the arguments ------------------------------------------------------------------------------

_INTS = ["num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels", "vocab_size"]
_INTS += ["ffn_hidden_size", "seq_length", "moe_router_topk"]
_FLOATS = ["rotary_base", "norm_epsilon", "rotary_percent"]
_BOOLS = ["swiglu", "untie_embeddings_and_output_weights", "qk_layernorm", "add_qkv_bias"]
_CHOICES = ["normalization", "position_embedding_type"]
_ANY_TYPE = ["32", [32], {"v": 32}, [], {}, "", "nan", "\x00"]
#: hostile values per kind of argument (None is Megatron-LM's "not set" and valid; so is 0 where allowed)
_HOSTILE = {
    "int": _ANY_TYPE + [True, False, -1, 0, 2**31, 2**63, 10**30, -(2**63), 32.5, math.nan, math.inf],
    "float": _ANY_TYPE + [True, -1, 0, -0.0, math.nan, math.inf, -math.inf, 1e400, -1e-300],
    "bool": _ANY_TYPE + [1, 0, "true", "false", math.nan],
    "choice": _ANY_TYPE + [1, True, ["RMSNorm"], "rmsnorm", "RMSNorm "],
}
_FIELDS = [(f, "int") for f in _INTS] + [(f, "float") for f in _FLOATS]
_FIELDS += [(f, "bool") for f in _BOOLS] + [(f, "choice") for f in _CHOICES]
#: whole documents that are not an object of arguments
_DOCUMENTS = [
    "[]",
    "1",
    '"args"',
    "null",
    "{",
    '{"num_layers": 2,}',
    "",
    "\xff\xfe",
    '{"a": ' + "{" * 5000 + "}" * 5000 + "}",
]


def _case(rng: random.Random) -> tuple[Any, str]:
    """One generated hostile config and the fragment its refusal must hold (the field's name)."""
    if rng.random() < 0.2:
        return rng.choice(_DOCUMENTS), ""
    field, kind = rng.choice(_FIELDS)
    value = rng.choice(_HOSTILE[kind])
    return {**ARGS, field: value}, f"{field}="


def test_import_mcore_fuzzed_hostile_args_are_each_one_line(tmp_path):
    """24 seeded cases: a known argument given a value of another JSON type, out of range, not
    finite; or a document that is no object. Each is refused in one line naming the file and the
    argument, nothing written, nothing changed."""
    rng = random.Random(52)
    seen = set()
    for i in range(24):
        content, fragment = _case(rng)
        case_dir = tmp_path / f"case{i}"
        case_dir.mkdir()
        line = _import_refused(case_dir, content, fragment)
        seen.add(line.split(": ", 2)[-1].split("=", 1)[0] if fragment else "document")
    assert len(seen) >= 8, seen  # the seed covers many arguments, not one


def test_a_valid_config_still_imports_under_the_cap(tmp_path):
    config = _write_config(tmp_path, ARGS)
    with address_cap():
        result = CliRunner().invoke(main, ["import-mcore", DENSE, str(tmp_path / "ckpt"), "--config", config])
    assert result.exit_code == 0, result.output
    assert os.path.isfile(tmp_path / "ckpt" / "mfsdp.json")


# ---- sizes: the estimate against the tensors present, and a fresh model against memory -------------------------


@pytest.mark.parametrize("name", ["dense", "moe_ep2", "deepseek"])
def test_the_parameter_estimate_is_a_lower_bound_of_the_tensors_an_import_holds(name, tmp_path):
    from mfsdp_ckpt.mcore import import_mcore
    from mfsdp_ckpt.mcore.config_check import check_against_tensors, estimate_parameters
    from mfsdp_ckpt.read.reader import CheckpointReader

    path = os.path.join(FIXTURES, name)
    result = import_mcore(path, tmp_path / "ckpt", config=path + ".config.json")
    with CheckpointReader(tmp_path / "ckpt") as reader:
        held = sum(reader.metadata.state_dict_metadata[k].size.numel() for k in reader.keys() if k.startswith("model."))
    estimate = estimate_parameters(result.model_config)
    assert 0.95 * held <= estimate <= held, (estimate, held)  # norms and biases are what it leaves out
    check_against_tensors(result.model_config, held, name)
    with pytest.raises(ConversionError, match=f"^{name}: the model config describes at least "):
        check_against_tensors(result.model_config, estimate - 1, name)


def test_a_fresh_model_larger_than_memory_is_refused_before_it_is_built():
    from mfsdp_ckpt.mcore.config_check import check_fits_memory, estimate_parameters

    fields = {**ARGS, "tie_embeddings": True, "num_query_groups": 2}
    assert check_fits_memory(fields, "f.json", available=GIB) == estimate_parameters(fields)
    with pytest.raises(ConversionError, match=r"^f\.json: the model has at least [\d,]+ parameters: .* more than"):
        check_fits_memory(fields, "f.json", copies=2, available=estimate_parameters(fields) * 4)


# ---- the trainer: mfsdp-train --mcore-config, and a recorded model_source ----------------------------------------

#: the trainer's refusals, in one process (imports once): each config's stderr and exit code, as JSON
_TRAIN = textwrap.dedent(
    """
    import contextlib, io, json, sys
    from cli.train import main
    out = []
    for config, ckpt in zip(sys.argv[1::2], sys.argv[2::2]):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                code = main(["--mcore-config", config, "--steps", "1", "--seq-len", "16", "--ckpt-dir", ckpt])
            except SystemExit as e:
                code = e.code
        out.append({"code": code, "stderr": err.getvalue()})
    print(json.dumps(out))
    """
)
_TRAIN_ARGS = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "num_query_groups": 2}
_TRAIN_ARGS.update(ffn_hidden_size=64, vocab_size=64, seq_length=32)
_TRAIN_CASES = {
    "rotary_base-nan": ({"rotary_base": math.nan}, "rotary_base=nan: expected a finite number"),
    "norm_epsilon-negative": ({"norm_epsilon": -1}, "norm_epsilon=-1: expected a finite number in (0, 1)"),
    "dropout-string": ({"hidden_dropout": "0.1"}, "hidden_dropout='0.1': expected a finite number in [0, 1]"),
    "passed-field-type": ({"recompute_granularity": 3}, "recompute_granularity=3: not a value of Megatron-Core's"),
    "passed-field-value": ({"cuda_graph_scope": "RMSNorm"}, "Megatron-Core refuses these arguments: KeyError"),
    "larger-than-memory": (
        {"vocab_size": 2**24, "hidden_size": 2**16, "num_attention_heads": 256, "num_query_groups": 256},
        "parameters: ",
    ),
}


def test_mfsdp_train_refuses_a_hostile_mcore_config_before_building(tmp_path):
    """``mfsdp-train --mcore-config`` (the ranks' check; one process here): one line naming the flag,
    the file and the argument, exit 1, no checkpoint directory, the file unchanged. Was: NaN and a
    negative epsilon trained; a string dropout, an int for a Literal field, a scope MCore does not
    know and a 4 TiB model ended in tracebacks from torch or Megatron-Core."""
    argv, expect = [], []
    for name, (change, says) in _TRAIN_CASES.items():
        config = _write_config(tmp_path, {**_TRAIN_ARGS, **change}, f"{name}.json")
        argv += [config, str(tmp_path / f"ck-{name}")]
        expect.append((config, says, _digest(config)))
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-c", _TRAIN, *argv], cwd=ROOT, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(run.stdout.strip().splitlines()[-1])
    for (config, says, digest), got, ckpt in zip(expect, results, argv[1::2]):
        lines = [line for line in got["stderr"].splitlines() if line.strip()]
        assert got["code"] == 1 and len(lines) == 1, (config, got)
        assert lines[0].startswith(f"error: --mcore-config {config}: ") and says in lines[0], (config, lines)
        assert not os.path.exists(ckpt) and _digest(config) == digest


def test_a_recorded_model_source_with_hostile_args_is_refused():
    """A checkpoint's ``model_source`` (what ``--resume`` rebuilds the model from), tampered."""
    from cli.mcore_source import McoreSource

    record = {"kind": "megatron-core", "args": {**_TRAIN_ARGS, "rotary_base": math.nan}, "layer_spec": "local"}
    with pytest.raises(ValueError) as e:
        McoreSource.from_record(record, "--resume: /ck/step_2")
    assert (
        str(e.value)
        == "--resume: /ck/step_2: model_source.args: rotary_base=nan: expected a finite number in (0, 1e+15]"
    )


_LAUNCHER = textwrap.dedent(
    """
    import sys
    from mfsdp_ckpt.errors import ConversionError
    from mfsdp_ckpt.mcore.config_check import check_mcore_config_file
    try:
        check_mcore_config_file(sys.argv[1], copies=2)
    except ConversionError as e:
        print(e)
    print("torch" in sys.modules)
    """
)


def test_the_launchers_check_of_an_mcore_config_imports_no_torch(tmp_path):
    """What the launcher can call before any rank starts (``check_mcore_config_file``): the same
    refusal without importing torch."""
    config = _write_config(tmp_path, {**_TRAIN_ARGS, "norm_epsilon": -1})
    env = {**os.environ, "PYTHONPATH": ROOT}
    run = subprocess.run([sys.executable, "-c", _LAUNCHER, config], cwd=ROOT, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == [f"{config}: norm_epsilon=-1: expected a finite number in (0, 1)", "False"]
