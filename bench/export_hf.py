"""HF export benchmark: ``mfsdp_ckpt.hf.export`` of a ≥ 2 GiB canonical checkpoint against the
usual route, loading the whole model with ``transformers`` and calling ``save_pretrained``.

    .venv/bin/python bench/export_hf.py                  # ~2.3 GB fp32 Llama-style model
    .venv/bin/python bench/export_hf.py --layers 4       # smaller

Each phase runs in its own fresh process, after an ``os.sync()``, which reports its wall time and its peak RSS
(``getrusage(RUSAGE_SELF).ru_maxrss``), so the phases do not share memory or caches of Python
objects (the OS page cache is shared: the files were just written, as after a training save).
Phases:

1. ``ours export``: canonical checkpoint -> HF directory (streaming, one tensor at a time);
2. ``transformers``: ``AutoModelForCausalLM.from_pretrained(<1's output>)`` then
   ``save_pretrained`` (the baseline: the whole model in memory);
3. ``ours import``: HF directory -> canonical checkpoint (streaming), for reference.

One run; prints a table and the ratios (baseline / ours).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _peak_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def phase_make(ckpt: str, layers: str) -> dict:
    """Write the canonical checkpoint (random fp32 weights, one tensor at a time)."""
    import torch

    from mfsdp_ckpt.hf.mapping import canonical_shapes
    from mfsdp_ckpt.streaming import CheckpointBuilder
    from mfsdp_core.models.gpt import GPTConfig

    config = GPTConfig(vocab_size=32000, hidden_size=2048, num_layers=int(layers), num_attention_heads=16,
                       num_query_groups=4, kv_channels=128, ffn_hidden_size=5632, seq_length=2048)
    manifest = {"writer": {"world_size": 1, "buffers": [], "groups": []}, "model_config": config.to_dict(),
                "step": None, "include_grads": False, "has_optimizer": False, "versions": {}}
    torch.manual_seed(0)
    total = 0
    with CheckpointBuilder(ckpt, manifest, sync=False) as builder:
        for key, shape in canonical_shapes(config).items():
            t = torch.randn(shape) * 0.02
            builder.add_tensor(key, t)
            total += t.numel() * 4
        builder.commit()
    return {"bytes": total}


def phase_ours_export(ckpt: str, out: str) -> dict:
    from mfsdp_ckpt.hf import export

    result = export(ckpt, out)
    return {"files": len(result.files), "bytes": result.bytes}


def phase_transformers(hf_dir: str, out: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model.save_pretrained(out, max_shard_size="5GB")
    return {"params": sum(p.numel() for p in model.parameters())}


def phase_ours_import(hf_dir: str, ckpt: str) -> dict:
    from mfsdp_ckpt.hf import import_

    result = import_(hf_dir, ckpt)
    return {"bytes": result.bytes}


PHASES = {"make": phase_make, "ours_export": phase_ours_export, "transformers": phase_transformers, "ours_import": phase_ours_import}


def _child(name: str, *args: str) -> dict:
    """Run one phase in a fresh process; its wall time and peak RSS. Dirty pages of the phase
    before are flushed first, so no phase pays for another's writeback."""
    os.sync()
    cmd = [sys.executable, os.path.abspath(__file__), "--phase", name, *args]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"phase {name} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", default="/tmp/mfsdp_bench_export_hf")
    p.add_argument("--layers", type=int, default=10, help="decoder layers (10: ~2.3 GB fp32)")
    p.add_argument("--keep", action="store_true", help="keep the files")
    p.add_argument("--phase", help=argparse.SUPPRESS)
    p.add_argument("args", nargs="*", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.phase:  # inside a child: run one phase, print one JSON line
        start = time.perf_counter()
        info = PHASES[a.phase](*a.args)
        info.update(seconds=time.perf_counter() - start, peak_rss_mib=_peak_mib())
        print(json.dumps(info))
        return

    shutil.rmtree(a.workdir, ignore_errors=True)
    os.makedirs(a.workdir)
    ckpt, ours, theirs, back = (os.path.join(a.workdir, n) for n in ("ckpt", "hf_ours", "hf_transformers", "ckpt_back"))
    try:
        made = _child("make", ckpt, str(a.layers))
        gib = made["bytes"] / 2**30
        print(f"checkpoint: {made['bytes'] / 1e9:.2f} GB ({gib:.2f} GiB) fp32, Llama-style, {a.layers} layers")
        rows = [
            ("ours export (mfsdp_ckpt.hf.export)", _child("ours_export", ckpt, ours)),
            ("transformers from_pretrained + save_pretrained", _child("transformers", ours, theirs)),
            ("ours import (mfsdp_ckpt.hf.import_)", _child("ours_import", ours, back)),
        ]
    finally:
        if not a.keep:
            shutil.rmtree(a.workdir, ignore_errors=True)
    print(f"\n{'phase':<48} {'wall s':>8} {'GB/s':>6} {'peak RSS MiB':>13}")
    for name, r in rows:
        print(f"{name:<48} {r['seconds']:8.2f} {made['bytes'] / 1e9 / r['seconds']:6.2f} {r['peak_rss_mib']:13,.0f}")
    ours_r, base = rows[0][1], rows[1][1]
    print(f"\nexport vs transformers: {base['seconds'] / ours_r['seconds']:.2f}x faster, "
          f"{base['peak_rss_mib'] / ours_r['peak_rss_mib']:.2f}x less peak memory "
          f"(ours {ours_r['peak_rss_mib']:,.0f} MiB for a {made['bytes'] / 2**20:,.0f} MiB model)")


if __name__ == "__main__":
    main()
