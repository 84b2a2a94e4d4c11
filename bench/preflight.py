"""How long ``mfsdp-train --nproc-per-node 2`` takes to refuse a run before any rank starts (issue
51: every refusal decidable from flags, files and configs in under 1.5 s; ``--help`` / ``--version``
under 0.5 s), against starting the interpreter and importing torch in the same run.

It writes a 2-step checkpoint of the ``tiny`` preset and a one-file Hugging Face Llama config, then
times each command ``--rounds`` times (medians): a refusal by the flags alone, by the model and
files (torch-free for the reference GPT), by the start checkpoint's manifest, by an ``--hf-model``
directory's config.json (torch-free, ``--ep`` of a dense family included) or by the model
transformers builds from it (torch and transformers imported: an activation it does not know), and by a Megatron-Core arguments file (torch-free).

    .venv/bin/python bench/preflight.py --dir /tmp/preflight_bench
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

BIN = os.path.dirname(sys.executable)
TRAIN = os.path.join(BIN, "mfsdp-train")
CKPT = os.path.join(BIN, "mfsdp-ckpt")

LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 256,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
}


#: what deciding a refusal by building the model costs at least: torch, transformers and the class
_LLAMA_IMPORT = "import transformers; transformers.LlamaForCausalLM"

MCORE = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "ffn_hidden_size": 128, "seq_length": 64}


def _cases(run: str, hf: str) -> list[tuple[str, list[str], str]]:
    """(name, argv, expected start of stderr's last line) per timed command."""
    step = os.path.join(run, "step_000002")
    bad_act = os.path.join(os.path.dirname(hf), "llama_bad_act")
    train = [TRAIN, "--nproc-per-node", "2"]
    return [
        ("python -c pass (baseline)", [sys.executable, "-c", "pass"], ""),
        ("import torch (baseline)", [sys.executable, "-c", "import torch"], ""),
        ("import transformers' Llama (baseline)", [sys.executable, "-c", _LLAMA_IMPORT], ""),
        ("mfsdp-train --help", [TRAIN, "--help"], ""),
        ("mfsdp-train --version", [TRAIN, "--version"], ""),
        ("mfsdp-ckpt --help", [CKPT, "--help"], ""),
        ("flags: --ep 3 on 2 ranks", [*train, "--model", "tiny-moe", "--ep", "3"], "error: --ep 3"),
        ("model: --seq-len over the model's", [*train, "--seq-len", "4096"], "error: --seq-len 4096"),
        ("file: --data not token ids", [*train, "--data", os.path.join(step, "odd.bin")], "error: --data"),
        ("checkpoint: other settings", [*train, "--resume", step, "--lr", "0.5"], "error: --resume:"),
        ("checkpoint: another model", [*train, "--resume", step, "--model", "tiny-moe"], "error: --resume:"),
        ("checkpoint: latest, --ep 2", [*train, "--resume", "--ckpt-dir", run, "--ep", "2"], "error: --ep 2"),
        ("--hf-model: --seq-len over the model's", [*train, "--hf-model", hf, "--seq-len", "4096"], "error: --seq-len"),
        ("--hf-model: --ep 2 of a dense family", [*train, "--hf-model", hf, "--ep", "2"], "error: --ep 2"),
        ("--hf-model: transformers cannot build it", [*train, "--hf-model", bad_act], "error:"),
        ("--mcore-config: NaN rotary_base", [*train, "--mcore-config", os.path.join(hf, "mcore.json")], "error:"),
    ]


def _time(argv: list[str], expect: str) -> float:
    t0 = time.perf_counter()
    out = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    took = time.perf_counter() - t0
    last = (out.stderr.strip().splitlines() or [""])[-1]
    if expect and not last.startswith(expect):
        raise SystemExit(f"{' '.join(argv)}: expected {expect!r}, got {last!r} (rc {out.returncode})")
    return took


def _setup(root: str) -> tuple[str, str]:
    shutil.rmtree(root, ignore_errors=True)
    run, hf = os.path.join(root, "run"), os.path.join(root, "llama")
    os.makedirs(hf)
    with open(os.path.join(hf, "config.json"), "w") as f:
        json.dump(LLAMA, f)
    os.makedirs(os.path.join(root, "llama_bad_act"))
    with open(os.path.join(root, "llama_bad_act", "config.json"), "w") as f:  # only transformers knows its activations
        json.dump({**LLAMA, "hidden_act": "no_such_activation"}, f)
    with open(os.path.join(hf, "mcore.json"), "w") as f:
        json.dump({**MCORE, "rotary_base": float("nan")}, f)
    argv = [TRAIN, "--model", "tiny", "--steps", "2", "--seq-len", "64", "--ckpt-dir", run, "--save-every", "2"]
    subprocess.run(argv, check=True, capture_output=True, timeout=600)
    with open(os.path.join(run, "step_000002", "odd.bin"), "wb") as f:  # 1001 bytes: no whole uint16 ids
        f.write(b"x" * 1001)
    return run, hf


def _target(name: str, times: dict[str, list[float]]) -> float | None:
    """The most seconds ``name`` may take (None: a baseline)."""
    if "baseline" in name:
        return None
    if "--help" in name or "--version" in name:
        return 0.5
    if "transformers cannot" in name:
        return statistics.median(times["import transformers' Llama (baseline)"]) + 1.5
    return 1.5


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default="/tmp/preflight_bench")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    run, hf = _setup(args.dir)
    cases = _cases(run, hf)
    times: dict[str, list[float]] = {name: [] for name, _, _ in cases}
    for _ in range(args.rounds):  # rounds alternate the commands, so a busy moment hits all alike
        for name, argv, expect in cases:
            times[name].append(_time(argv, expect))
    torch_s = statistics.median(times["import torch (baseline)"])
    print(f"{'command':42} {'median s':>9} {'min s':>7} {'x import torch':>15} target")
    for name, _, _ in cases:
        med, low = statistics.median(times[name]), min(times[name])
        limit = _target(name, times)
        target = "" if limit is None else f"{limit:.1f} s"
        verdict = "" if limit is None else ("met" if med <= limit else "MISSED")
        print(f"{name:42} {med:9.3f} {low:7.3f} {med / torch_s:15.2f} {target} {verdict}")
    print("(a refusal only the model transformers builds can decide: importing it, plus 1.5 s)")


if __name__ == "__main__":
    main()
