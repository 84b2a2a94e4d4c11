"""How large the ``inspect --html`` page of a 1,000-tensor checkpoint is and how long a headless
Chromium takes to render it (issue 34: under 5 MB, under 5 s).

The checkpoint: 1,000 small tensors saved by stock ``dcp.save`` in one process, then resharded
offline to 3 ranks (``mfsdp-ckpt reshard``), so each tensor has chunks from several ranks.
Times are medians of ``--rounds`` screenshot runs (a fresh browser each time, as ``--png`` runs it).

    .venv/bin/python bench/report_page.py --dir /tmp/report_bench
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed.checkpoint as dcp

from mfsdp_ckpt.tools.report.browser import screenshot
from mfsdp_ckpt.tools.report.inspect_page import inspect_html

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default="/tmp/report_bench")
    p.add_argument("--tensors", type=int, default=1000)
    p.add_argument("--world-size", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    src, dst = os.path.join(args.dir, "src"), os.path.join(args.dir, "w3")
    g = torch.Generator().manual_seed(0)
    state = {f"model.layers.{i}.weight": torch.randn(17 + i % 13, 8 + i % 5, generator=g) for i in range(args.tensors)}
    dcp.save(state, checkpoint_id=src, no_dist=True)
    cmd = [sys.executable, "-m", "cli.main", "reshard", src, dst, "--world-size", str(args.world_size)]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)
    page = os.path.join(args.dir, "page.html")
    t0 = time.perf_counter()
    inspect_html(dst, page)
    build = time.perf_counter() - t0
    renders = []
    for r in range(args.rounds):
        t0 = time.perf_counter()
        screenshot(page, os.path.join(args.dir, f"page{r}.png"))
        renders.append(time.perf_counter() - t0)
    size = os.path.getsize(page) / 1e6
    render = statistics.median(renders)
    print(
        f"tensors {args.tensors}, world size {args.world_size}: page {size:.2f} MB (target < 5 MB), "
        f"built in {build:.2f} s, rendered in {render:.2f} s median of {args.rounds} "
        f"({', '.join(f'{x:.2f}' for x in renders)}; target < 5 s)"
    )


if __name__ == "__main__":
    main()
