"""Hostile model configs: a ``config.json`` given to ``mfsdp-train --hf-model DIR``, the same record
inside a checkpoint (``model_source``, tampered and re-sealed as an attacker would) given to
``--resume`` and to ``export-hf``. Each is refused before any model is built: one line naming the
file and the field, exit 1, nothing written, the input unchanged; never a traceback from
transformers or torch, an allocation of what the config asks (a 4 TiB model), or minutes of
building. ``auto_map`` / ``trust_remote_code`` are never recorded or exported.

The command lines run in one fresh interpreter under a 6 GiB address-space cap (``RLIMIT_AS``),
one case after another (the trainer's launcher, its rank launch replaced by a failure: a refusal
must come first); each case has a deadline there, so a config that builds for minutes fails the
test instead of stalling it. The checks themselves import neither torch nor transformers
(:mod:`mfsdp_ckpt.hf.config_check`, the launcher's pre-flight)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import warnings
from typing import Any

import pytest
import torch

from tests.hf_models import CONFIGS, hf_config, make_hf_dir

from .test_hostile_support import ROOT, edit_manifest, fresh_copy, run_cli_cases

CAP = 6 * 2**30  # the address space each command line gets (torch and transformers import in ~1.5 GiB)
DEADLINE = 120  # seconds one case may take in the driver (the refusals take about one)


def _snapshot(*paths: str) -> dict[str, bytes | None]:
    """Every file under ``paths`` (relative name -> bytes; directories as None)."""
    out: dict[str, bytes | None] = {}
    for root in paths:
        for directory, _, files in os.walk(root):
            out[directory] = None
            for name in files:
                with open(os.path.join(directory, name), "rb") as f:
                    out[os.path.join(directory, name)] = f.read()
    return out


# ---- the inputs ----------------------------------------------------------------------------------

BIG = dict(  # about 1.1e12 parameters: 4.1 TiB in fp32
    vocab_size=128000,
    hidden_size=16384,
    intermediate_size=53248,
    num_attention_heads=128,
    num_key_value_heads=128,
    head_dim=128,
    num_hidden_layers=300,
)

#: (id, weights in the directory?, config.json changes, the start of the refusal after "DIR/config.json: ")
TRAIN_CASES = [
    ("negative-hidden", False, {"hidden_size": -32}, "hidden_size = -32 must be a positive integer"),
    ("huge-hidden", False, {"hidden_size": 2**40}, "hidden_size = 1099511627776 must be a positive integer of at most"),
    ("million-layers", True, {"num_hidden_layers": 10**6}, "num_hidden_layers = 1000000 must be a positive integer"),
    ("zero-heads", True, {"num_attention_heads": 0}, "num_attention_heads = 0 must be a positive integer"),
    ("billion-vocab", False, {"vocab_size": 10**9}, "vocab_size = 1000000000 must be a positive integer of at most"),
    ("bool-layers", False, {"num_hidden_layers": True}, "num_hidden_layers = true must be a positive integer"),
    ("kv-heads", False, {"num_key_value_heads": 3}, "num_key_value_heads = 3 must divide num_attention_heads = 4"),
    ("nan-rope", False, {"rope_parameters": {"rope_type": "default", "rope_theta": float("nan")}}, "rope_parameters"),
    ("4-tib-fresh", False, BIG, "the config describes a model of about 1,1"),
    (
        "more-than-the-weights",
        True,
        {**BIG, "vocab_size": 96, "hidden_size": 32, "num_hidden_layers": 10**3},
        "the config ",
    ),
]

#: (id, model_source.config changes, the refusal after "--resume: CKPT: model_source.config: ")
RESUME_CASES = [
    ("zero-heads", {"num_attention_heads": 0}, "num_attention_heads = 0 must be a positive integer"),
    ("billion-vocab", {"vocab_size": 10**9}, "vocab_size = 1000000000 must be a positive integer of at most"),
    ("4-tib", BIG, "the config describes a model of about 1,1"),
]

#: (id, model_source.config changes, the refusal after "CKPT: model_source.config: ")
EXPORT_CASES = [
    ("vocab", {"vocab_size": 97}, "vocab_size = 97 does not match model.embed_tokens.weight (96, 32)"),
    ("hidden", {"hidden_size": 48}, "hidden_size = 48 does not match model.embed_tokens.weight (96, 32)"),
    ("layers", {"num_hidden_layers": 3}, "num_hidden_layers = 3, but the tensors hold 2 decoder layers"),
    ("zero-heads", {"num_attention_heads": 0}, "num_attention_heads = 0 must be a positive integer"),
]

REMOTE = {"auto_map": {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}, "trust_remote_code": True}
EVIL_TOKENIZER = json.dumps({"auto_map": {"AutoTokenizer": ["tokenizer_evil.Evil", None]}, "model_max_length": 64})


def _edited_dir(src: str, dst: str, changes: dict[str, Any]) -> str:
    shutil.copytree(src, dst)
    path = os.path.join(dst, "config.json")
    with open(path) as f:
        config = json.load(f)
    config.update(changes)
    with open(path, "w") as f:
        json.dump(config, f)  # NaN as JSON's NaN, which Python's and transformers' readers accept
    return dst


def _transformers_checkpoint(path: str) -> str:
    """A checkpoint of a tiny transformers Llama (what ``--hf-model`` runs save: ``model_source``
    kind ``transformers``), written in this process, carrying a tokenizer config that names code
    and the code file itself."""
    from transformers import AutoModelForCausalLM

    from mfsdp_ckpt import save
    from mfsdp_core import fully_shard

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config("llama"))
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    carried = {"tokenizer_config.json": EVIL_TOKENIZER.encode(), "tokenizer_evil.py": b"raise SystemExit('ran')\n"}
    files = {n: torch.frombuffer(bytearray(b), dtype=torch.uint8) for n, b in carried.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's "assuming a single process" notice
        return save(path, model, extra={"hf_files": files})


def _with_config(ckpt: str, dst: str, changes: dict[str, Any]) -> str:
    fresh_copy(ckpt, dst)
    edit_manifest(dst, lambda m: m["model_source"]["config"].update(changes))  # re-sealed, as an attacker would
    return dst


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """Every case's inputs, their files before, and what the command lines did."""
    tmp = tmp_path_factory.mktemp("hostile_config")
    weights, fresh = make_hf_dir(tmp / "weights", "llama"), make_hf_dir(tmp / "fresh", "llama", weights=False)
    ckpt = _transformers_checkpoint(str(tmp / "ckpt"))
    cases, expect = [], {}
    for case_id, with_weights, changes, message in TRAIN_CASES:
        src = _edited_dir(weights if with_weights else fresh, str(tmp / f"train-{case_id}"), changes)
        argv = ["--nproc-per-node", "1", "--hf-model", src, "--steps", "1", "--ckpt-dir", src + "-ck"]
        cases.append((f"train-{case_id}", "train", argv))
        expect[f"train-{case_id}"] = (f"{src}/config.json: {message}", src)
    for case_id, changes, message in RESUME_CASES:
        src = _with_config(ckpt, str(tmp / f"resume-{case_id}"), changes)
        argv = ["--nproc-per-node", "1", "--resume", src, "--steps", "2", "--ckpt-dir", src + "-ck"]
        cases.append((f"resume-{case_id}", "train", argv))
        expect[f"resume-{case_id}"] = (f"--resume: {src}: model_source.config: {message}", src)
    for case_id, changes, message in EXPORT_CASES:
        src = _with_config(ckpt, str(tmp / f"export-{case_id}"), changes)
        cases.append((f"export-{case_id}", "ckpt", ["export-hf", src, src + "-ck"]))
        expect[f"export-{case_id}"] = (f"{src}: model_source.config: {message}", src)
    remote = _with_config(ckpt, str(tmp / "remote"), REMOTE)
    cases.append(("export-remote", "ckpt", ["export-hf", remote, str(tmp / "remote-hf")]))
    before = _snapshot(str(tmp))
    results = run_cli_cases(cases, CAP, DEADLINE)
    return {"tmp": str(tmp), "expect": expect, "before": before, "results": results, "remote": remote}


def _assert_refused(outcomes: dict[str, Any], case: str) -> None:
    result = outcomes["results"][case]
    message, src = outcomes["expect"][case]
    assert not result["hung"], f"{case}: still running after {DEADLINE} s"
    assert result["crash"] is None, f"{case}: {result['crash']}"
    err = result["stderr"].strip()
    assert result["rc"] == 1 and len(err.splitlines()) == 1, f"{case}: exit {result['rc']}: {err[-2000:]}"
    assert err.startswith(f"error: {message}"), err
    assert not os.path.lexists(src + "-ck"), "something was written"
    before = {k: v for k, v in outcomes["before"].items() if k == src or k.startswith(src + os.sep)}
    assert _snapshot(src) == before, "the input changed"


@pytest.mark.parametrize("case", [c[0] for c in TRAIN_CASES])
def test_hf_model_config_is_refused_by_the_launcher(outcomes, case):
    _assert_refused(outcomes, f"train-{case}")


@pytest.mark.parametrize("case", [c[0] for c in RESUME_CASES])
def test_resume_of_a_tampered_model_source_is_refused(outcomes, case):
    _assert_refused(outcomes, f"resume-{case}")


@pytest.mark.parametrize("case", [c[0] for c in EXPORT_CASES])
def test_export_hf_refuses_a_config_that_does_not_describe_the_tensors(outcomes, case):
    _assert_refused(outcomes, f"export-{case}")
    assert os.listdir(outcomes["tmp"]) == [n for n in os.listdir(outcomes["tmp"]) if "partial" not in n]


def test_export_hf_never_writes_remote_code(outcomes):
    result = outcomes["results"]["export-remote"]
    assert result["rc"] == 0, result["stderr"]
    out = os.path.join(outcomes["tmp"], "remote-hf")
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(out, "tokenizer_config.json")) as f:
        tokenizer = json.load(f)
    assert "auto_map" not in config and "trust_remote_code" not in config, sorted(config)
    assert tokenizer == {"model_max_length": 64}
    assert not os.path.exists(os.path.join(out, "tokenizer_evil.py"))
    assert config["num_hidden_layers"] == CONFIGS["llama"]["num_hidden_layers"]


def test_hf_model_records_no_remote_code(tmp_path):
    from cli.hf_source import HFSource

    src = _edited_dir(make_hf_dir(tmp_path / "src", "llama", weights=False), str(tmp_path / "m"), REMOTE)
    record = HFSource.from_dir(src).record()
    assert "auto_map" not in record["config"] and "trust_remote_code" not in record["config"]
    assert record["class"] == "LlamaForCausalLM"


def test_nothing_passes_trust_remote_code():
    found = []
    for package in ("cli", "mfsdp_ckpt", "mfsdp_core"):
        for directory, _, files in os.walk(os.path.join(ROOT, package)):
            for name in files:
                if name.endswith(".py"):
                    with open(os.path.join(directory, name), encoding="utf-8") as f:
                        text = f.read().replace(" ", "")
                    if "trust_remote_code=True" in text:
                        found.append(os.path.join(directory, name))
    assert not found


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_the_estimate_counts_the_parameters_transformers_builds(family):
    from transformers import AutoModelForCausalLM

    from mfsdp_ckpt.hf.config_check import estimated_param_bytes, estimated_params

    config = hf_config(family)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    built = sum(p.numel() for p in model.parameters())
    # within 1% (the estimate leaves out biases and q/k norms: Qwen2's and Qwen3's hundred-odd)
    assert abs(estimated_params(config.to_dict()) - built) <= 0.01 * built, (estimated_params(config.to_dict()), built)
    assert estimated_param_bytes(config.to_dict()) == 4 * estimated_params(config.to_dict())


def test_the_check_of_a_model_directory_imports_neither_torch_nor_transformers(tmp_path):
    src = _edited_dir(make_hf_dir(tmp_path / "src", "llama", weights=False), str(tmp_path / "m"), {"head_dim": 0})
    probe = textwrap.dedent(
        f"""
        import sys
        from mfsdp_ckpt.errors import ConversionError
        from mfsdp_ckpt.hf.config_check import check_hf_model_dir
        try:
            check_hf_model_dir({src!r})
        except ConversionError as e:
            print(e)
        print("torch" in sys.modules, "transformers" in sys.modules)
        """
    )
    run = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == [f"{src}/config.json: head_dim = 0 must be a positive integer", "False False"]
