"""Hostile reference-GPT model configs (``--model-config FILE``, a checkpoint's recorded
``model_source``) are refused by the launcher in one line naming the file and the field, before any
rank starts and before anything is built: every field of its type (an integer is no bool or float,
a number is finite), sizes within bounds, and a lower bound of the parameters within this machine's
memory. Each case: exit 1, one line, no ``--ckpt-dir`` created, the input unchanged.

All cases run in one interpreter (``cli.train.main`` with the rank launcher replaced by a failure),
under an address-space cap, so that a config that allocated what it asks would fail the test rather
than the machine."""

from __future__ import annotations

import hashlib
import json
import os

import pytest

from tests.reliability.test_hostile_support import MODEL_CONFIG, edit_manifest, run_cli_cases, save_small

CAP = 4 << 30  # torch is not imported on this path; the process needs well under 1 GiB

# field -> a hostile value, and what the one line must say
CASES = {
    "float-width": ("hidden_size", 64.5, "GPTConfig.hidden_size must be an integer"),
    "bool-layers": ("num_layers", True, "GPTConfig.num_layers must be an integer"),
    "string-heads": ("num_attention_heads", "4", "GPTConfig.num_attention_heads must be an integer"),
    "million-layers": ("num_layers", 10**6, "GPTConfig.num_layers must be at most 4096"),
    "billion-vocab": ("vocab_size", 10**9, "GPTConfig.vocab_size must be at most 16777216"),
    "huge-int": ("ffn_hidden_size", 10**400, "GPTConfig.ffn_hidden_size must be at most"),
    "nan-rope": ("rotary_base", float("nan"), "GPTConfig.rotary_base must be a finite number"),
    "string-eps": ("norm_epsilon", "1e-5", "GPTConfig.norm_epsilon must be a finite number"),
    "int-flag": ("qk_layernorm", 1, "GPTConfig.qk_layernorm must be true or false"),
    "kinds-not-a-list": ("layer_kinds", 5, "GPTConfig.layer_kinds must be a list"),
    "negative-experts": ("num_experts", -8, "num_experts must be >= 0"),
    "4-tib": ("hidden_size", 1 << 20, "more than this machine's memory"),
    # fits this machine (2 GiB in fp32) but not the checkpoint it is recorded in (tested on resume only)
    "larger-than-its-tensors": ("hidden_size", 4096, "bytes of tensors the checkpoint holds"),
}


def _run_launcher(argvs: list[list[str]]) -> list[tuple[int, str, bool]]:
    """``(exit code, stderr, torch imported)`` of each trainer command line, all in one capped
    interpreter whose rank launch is replaced by a failure."""
    results = run_cli_cases([(str(i), "train", argv) for i, argv in enumerate(argvs)], CAP)
    return [(r.get("rc"), r["stderr"], r["torch"]) for r in (results[str(i)] for i in range(len(argvs)))]


def _digest(path: str) -> str:
    files = (
        sorted(os.path.join(d, f) for d, _, names in os.walk(path) for f in names) if os.path.isdir(path) else [path]
    )
    return hashlib.sha256(b"".join(open(f, "rb").read() for f in files)).hexdigest()


def _hostile(field: str, value: object) -> dict:
    config = dict(MODEL_CONFIG, **{field: value})
    if field == "hidden_size" and value == 1 << 20:  # 2^24 x 2^20 embeddings: 2^45 parameters
        config["vocab_size"] = 1 << 24
    if field == "hidden_size" and value == 4096:  # 2 x 65,536 x 4096 embeddings: 2^29 parameters
        config["vocab_size"] = 1 << 16
    return config


def _assert_refused(result: tuple[int, str, bool], prefix: str, says: str, out_dir: str) -> None:
    code, err, torch_imported = result
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1, err
    assert lines[0].startswith(prefix) and says in lines[0], lines[0]
    assert not torch_imported, "the refusal imported torch"
    assert not os.path.exists(out_dir), f"{out_dir} was created"


def test_hostile_model_config_files_are_refused_before_any_rank_starts(tmp_path) -> None:
    argvs, expected = [], []
    for name, (field, value, says) in CASES.items():
        if name == "larger-than-its-tensors":
            continue
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(_hostile(field, value)))
        out = str(tmp_path / f"{name}.out")
        argvs.append(["--nproc-per-node", "2", "--model-config", str(path), "--ckpt-dir", out, "--steps", "1"])
        expected.append((str(path), says, out, _digest(str(path))))
    for result, (path, says, out, digest) in zip(_run_launcher(argvs), expected):
        _assert_refused(result, f"error: --model-config {path}: ", says, out)
        assert _digest(path) == digest


@pytest.mark.parametrize("name", ["million-layers", "nan-rope", "4-tib", "larger-than-its-tensors"])
def test_a_tampered_recorded_model_is_refused_on_resume(tmp_path, name: str) -> None:
    field, value, says = CASES[name]
    ckpt = save_small(str(tmp_path / "ckpt"), listed=False)

    def tamper(manifest: dict) -> None:
        manifest.pop("model_source", None)
        manifest["model_config"] = _hostile(field, value)

    edit_manifest(ckpt, tamper)
    digest, out = _digest(ckpt), str(tmp_path / "out")
    argv = ["--nproc-per-node", "2", "--resume", ckpt, "--ckpt-dir", out, "--steps", "1"]
    (result,) = _run_launcher([argv])
    _assert_refused(result, "error: --resume: ", says, out)
    assert _digest(ckpt) == digest
