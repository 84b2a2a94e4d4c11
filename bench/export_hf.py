"""HF export / import benchmark: ``mfsdp_ckpt.hf.export`` / ``import_`` of a ≥ 2 GiB model
against the usual routes through ``transformers``, in one run.

    .venv/bin/python bench/export_hf.py                  # ~2.3 GB fp32 Llama-style model, default workers
    .venv/bin/python bench/export_hf.py --workers 1      # one thread (the serial path)
    .venv/bin/python bench/export_hf.py --layers 4 --rounds 1   # smaller and quicker

Setup (not timed): a canonical checkpoint of random fp32 weights, and its HF export with one
worker, the common input of every phase that reads an HF directory. Each timed phase then runs
in its own fresh process, after an ``os.sync()`` and an untimed read of its input (so every
phase reads from the page cache, as right after a training save, whatever else the machine's
other jobs did to the cache), and reports its wall time (from before its imports) and its peak
RSS (``getrusage(RUSAGE_SELF).ru_maxrss``); each output is deleted after its phase. Phases:

1. ``ours export``: canonical checkpoint -> HF directory (``--workers`` threads, fsynced);
2. ``transformers load + save``: ``AutoModelForCausalLM.from_pretrained`` of the HF directory,
   then ``save_pretrained`` (the export baseline: the whole model in memory, nothing fsynced);
3. ``ours import``: HF directory -> canonical checkpoint (``--workers`` threads, fsynced);
4. ``transformers from_pretrained``: the import baseline (it maps the safetensors files and may
   leave weights unread until used);
5. ``dd``: the physical reference, ``dd conv=fdatasync`` of the checkpoint's data file (the same
   bytes read and durably written, as ours must before its commit);
6. ``transformers load + save + fsync``: phase 2, then every file it wrote fsynced: the same
   durable result as ours export;
7. ``transformers from_pretrained + DCP save``: phase 4, then stock ``dcp.save`` of the model's
   state dict (``FileSystemWriter``, which fsyncs): the usual route from an HF directory to a
   durable DCP checkpoint, the same work as ours import.

Phases 2 and 4 are the peers the targets name. Neither asks for durability and phase 4 writes
nothing at all, so an importer that commits its output cannot be faster than phase 4 once the
durable write alone (phase 5) takes longer. Phases 6 and 7 do the same work as ours, and their
ratios are printed too.

``--rounds`` repetitions in rotated order (the disk's speed drifts with what ran before); the
medians are reported, with the ratios (baseline time / ours: > 1 means ours is faster) and the
peak RSS per worker against the bound (largest tensor + 512 MiB per worker). After the first
round the export is compared byte for byte with the one-worker export of the setup.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 2**20


def _peak_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def phase_make(ckpt: str, layers: str) -> dict:
    """Write the canonical checkpoint (random fp32 weights, one tensor at a time)."""
    import torch

    from mfsdp_ckpt.hf.mapping import canonical_shapes
    from mfsdp_ckpt.write.builder import CheckpointBuilder
    from mfsdp_core.models.gpt import GPTConfig

    config = GPTConfig(
        vocab_size=32000,
        hidden_size=2048,
        num_layers=int(layers),
        num_attention_heads=16,
        num_query_groups=4,
        kv_channels=128,
        ffn_hidden_size=5632,
        seq_length=2048,
    )
    manifest = {
        "writer": {"world_size": 1, "buffers": [], "groups": []},
        "model_config": config.to_dict(),
        "step": None,
        "include_grads": False,
        "has_optimizer": False,
        "versions": {},
    }
    torch.manual_seed(0)
    total = largest = 0
    with CheckpointBuilder(ckpt, manifest, sync=False) as builder:
        for key, shape in canonical_shapes(config).items():
            t = torch.randn(shape) * 0.02
            builder.add_tensor(key, t)
            total += t.numel() * 4
            largest = max(largest, t.numel() * 4)
        builder.commit()
    return {"bytes": total, "largest": largest}


def phase_ours_export(ckpt: str, out: str, workers: str) -> dict:
    from mfsdp_ckpt.hf import export

    result = export(ckpt, out, workers=int(workers))
    return {"files": len(result.files), "bytes": result.bytes}


def phase_transformers(hf_dir: str, out: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model.save_pretrained(out, max_shard_size="5GB")
    return {"params": sum(p.numel() for p in model.parameters())}


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def phase_transformers_durable(hf_dir: str, out: str) -> dict:
    """Phase 2 made durable: every file it wrote, then the directory, fsynced (not importing
    ``mfsdp_ckpt``'s helpers, whose import would be timed here)."""
    info = phase_transformers(hf_dir, out)
    for d, _, names in os.walk(out):
        for n in names:
            _fsync(os.path.join(d, n))
    _fsync(out)
    return info


def phase_from_pretrained_dcp(hf_dir: str, out: str) -> dict:
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    with warnings.catch_warnings():  # DCP's notice that it runs without a process group
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(model.state_dict(), storage_writer=dcp.FileSystemWriter(out))
    return {"params": sum(p.numel() for p in model.parameters())}


def phase_ours_import(hf_dir: str, ckpt: str, workers: str) -> dict:
    from mfsdp_ckpt.hf import import_

    result = import_(hf_dir, ckpt, workers=int(workers))
    return {"bytes": result.bytes}


def phase_from_pretrained(hf_dir: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    return {"params": sum(p.numel() for p in model.parameters())}


def phase_dd(ckpt: str, out: str) -> dict:
    """The physical reference: ``dd`` copies the checkpoint's data files and fdatasyncs them
    (the same bytes read and durably written, no conversion)."""
    os.makedirs(out)
    for n in sorted(os.listdir(ckpt)):
        if n.endswith(".distcp"):
            subprocess.run(
                ["dd", f"if={os.path.join(ckpt, n)}", f"of={os.path.join(out, n)}", "bs=16M", "conv=fdatasync"],
                check=True,
                capture_output=True,
            )
    return {}


PHASES = {
    "make": phase_make,
    "dd": phase_dd,
    "ours_export": phase_ours_export,
    "transformers": phase_transformers,
    "ours_import": phase_ours_import,
    "from_pretrained": phase_from_pretrained,
    "transformers_durable": phase_transformers_durable,
    "from_pretrained_dcp": phase_from_pretrained_dcp,
}


def _warm(path: str) -> None:
    """Read every file under ``path`` once (untimed), so that a phase reads its input from the
    page cache, as right after it was written, whatever other jobs on the machine did to the
    cache in between."""
    buf = bytearray(16 * MiB)
    for d, _, names in os.walk(path):
        for n in names:
            with open(os.path.join(d, n), "rb", buffering=0) as f:
                while f.readinto(buf):
                    pass


def _child(name: str, *args: str, warm: str | None = None) -> dict:
    """Run one phase in a fresh process; its wall time and peak RSS. Dirty pages of the phase
    before are flushed first, so no phase pays for another's writeback; ``warm``: its input,
    read once first (see :func:`_warm`)."""
    os.sync()
    if warm:
        _warm(warm)
    cmd = [sys.executable, os.path.abspath(__file__), "--phase", name, *args]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"phase {name} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _same_files(a: str, b: str) -> bool:
    names = sorted(os.listdir(a))
    return names == sorted(os.listdir(b)) and all(
        filecmp.cmp(os.path.join(a, n), os.path.join(b, n), shallow=False) for n in names
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", default="/tmp/mfsdp_bench_export_hf")
    p.add_argument("--layers", type=int, default=10, help="decoder layers (10: ~2.3 GB fp32)")
    p.add_argument("--workers", type=int, default=None, help="threads for ours (default: the bridge's, min(4, CPUs))")
    p.add_argument("--rounds", type=int, default=3, help="repetitions in rotated order; medians are reported")
    p.add_argument("--keep", action="store_true", help="keep the files")
    p.add_argument(
        "--only",
        default=None,
        help="comma-separated phases to time (default: all): " + ", ".join(k for k in PHASES if k != "make"),
    )
    p.add_argument("--phase", help=argparse.SUPPRESS)
    p.add_argument("args", nargs="*", help=argparse.SUPPRESS)
    a = p.parse_args()
    timed = [k for k in PHASES if k != "make"]
    unknown = sorted(set(a.only.split(",")) - set(timed)) if a.only is not None else []
    if unknown:  # refused before the work directory is touched
        p.error(f"--only: unknown phase(s) {', '.join(repr(u) for u in unknown)}; choose from {', '.join(timed)}")
    if a.phase:  # inside a child: run one phase, print one JSON line
        start = time.perf_counter()
        info = PHASES[a.phase](*a.args)
        info.update(seconds=time.perf_counter() - start, peak_rss_mib=_peak_mib())
        print(json.dumps(info))
        return
    if a.workers is None:
        a.workers = max(
            1, min(4, os.cpu_count() or 1)
        )  # mfsdp_ckpt.hf.workers.default_workers, without importing torch here

    shutil.rmtree(a.workdir, ignore_errors=True)
    os.makedirs(a.workdir)
    ckpt, src, ours, theirs, back = (
        os.path.join(a.workdir, n) for n in ("ckpt", "hf_src", "hf_ours", "hf_transformers", "ckpt_back")
    )
    copy, theirs_dcp = os.path.join(a.workdir, "dd_copy"), os.path.join(a.workdir, "dcp_from_transformers")
    outputs = {
        "ours_export": ours,
        "transformers": theirs,
        "ours_import": back,
        "from_pretrained": None,
        "dd": copy,
        "transformers_durable": theirs,
        "from_pretrained_dcp": theirs_dcp,
    }
    inputs = {
        "ours_export": ckpt,
        "transformers": src,
        "ours_import": src,
        "from_pretrained": src,
        "dd": ckpt,
        "transformers_durable": src,
        "from_pretrained_dcp": src,
    }
    calls = {
        "ours_export": (ckpt, ours, str(a.workers)),
        "transformers": (src, theirs),
        "ours_import": (src, back, str(a.workers)),
        "from_pretrained": (src,),
        "dd": (ckpt, copy),
        "transformers_durable": (src, theirs),
        "from_pretrained_dcp": (src, theirs_dcp),
    }
    order = list(calls) if a.only is None else [n for n in calls if n in a.only.split(",")]
    times: dict[str, list[dict]] = {name: [] for name in order}
    identical = None
    try:
        made = _child("make", ckpt, str(a.layers))
        _child("ours_export", ckpt, src, "1")  # the common HF input, and the reference bytes
        print(
            f"checkpoint: {made['bytes'] / 1e9:.2f} GB ({made['bytes'] / 2**30:.2f} GiB) fp32, Llama-style, {a.layers} layers, "
            f"largest tensor {made['largest'] / MiB:,.0f} MiB; ours with {a.workers} worker(s); {a.rounds} round(s)"
        )
        for r in range(a.rounds):
            for name in order[r % len(order) :] + order[: r % len(order)]:
                times[name].append(_child(name, *calls[name], warm=inputs[name]))
                if name == "ours_export" and identical is None:
                    identical = _same_files(src, ours)
                if outputs[name] and not a.keep:  # only the inputs stay in the page cache
                    shutil.rmtree(outputs[name], ignore_errors=True)
    finally:
        if not a.keep:
            shutil.rmtree(a.workdir, ignore_errors=True)

    def med(name: str, field: str) -> float:
        return statistics.median(r[field] for r in times[name])

    labels = {
        "ours_export": f"ours export (hf.export, {a.workers} workers)",
        "transformers": "transformers from_pretrained + save_pretrained",
        "ours_import": f"ours import (hf.import_, {a.workers} workers)",
        "from_pretrained": "transformers from_pretrained",
        "dd": "dd copy of the data file, fdatasync (reference)",
        "transformers_durable": "transformers load + save_pretrained + fsync",
        "from_pretrained_dcp": "transformers from_pretrained + stock DCP save",
    }
    print(
        f"\n{'phase (median of ' + str(a.rounds) + ')':<50} {'wall s':>8} {'GB/s':>6} {'peak RSS MiB':>13}  all rounds (s)"
    )
    for name in order:
        secs = [r["seconds"] for r in times[name]]
        print(
            f"{labels[name]:<50} {med(name, 'seconds'):8.2f} {made['bytes'] / 1e9 / med(name, 'seconds'):6.2f} "
            f"{med(name, 'peak_rss_mib'):13,.0f}  {', '.join(f'{s:.2f}' for s in secs)}"
        )
    bound = made["largest"] / MiB + 512
    have = set(order)
    print()
    if {"transformers", "ours_export"} <= have:
        print(
            f"export: {med('transformers', 'seconds') / med('ours_export', 'seconds'):.2f}x the speed of transformers' "
            f"load + save_pretrained (target >= 1.5x)"
        )
    if {"from_pretrained", "ours_import"} <= have:
        print(
            f"import: {med('from_pretrained', 'seconds') / med('ours_import', 'seconds'):.2f}x the speed of transformers' "
            f"from_pretrained (target >= 1.5x)"
        )
    if {"transformers_durable", "from_pretrained_dcp", "ours_export", "ours_import"} <= have:
        print(
            f"same durable work: export {med('transformers_durable', 'seconds') / med('ours_export', 'seconds'):.2f}x the speed "
            f"of transformers' load + save_pretrained + fsync, import {med('from_pretrained_dcp', 'seconds') / med('ours_import', 'seconds'):.2f}x "
            f"that of from_pretrained + stock DCP save"
        )
    for name in [n for n in ("ours_export", "ours_import") if n in have]:
        per = med(name, "peak_rss_mib") / a.workers
        print(
            f"{name.replace('_', ' ')}: peak RSS {med(name, 'peak_rss_mib'):,.0f} MiB = {per:,.0f} MiB per worker "
            f"(bound: largest tensor + 512 MiB = {bound:,.0f} MiB per worker: {'met' if per <= bound else 'MISSED'})"
        )
    if {"dd", "ours_export", "ours_import"} <= have:
        dd = med("dd", "seconds")
        print(
            f"against dd's durable copy of the same bytes ({dd:.2f} s): export {med('ours_export', 'seconds') / dd:.2f}x "
            f"dd's time, import {med('ours_import', 'seconds') / dd:.2f}x (target <= 1.05x each; ours includes "
            "starting Python and torch)"
        )
    if "ours_export" in have:
        print(
            f"export with {a.workers} worker(s) byte-identical to the 1-worker export: {'yes' if identical else 'NO'}"
        )


if __name__ == "__main__":
    main()
