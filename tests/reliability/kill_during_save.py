"""A 2-rank training save that SIGKILLs one of its ranks at a chosen point (child of
test_kill_during_save.py, launched with torchrun):

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/reliability/kill_during_save.py \\
        RUN STEP [TARGET WHEN NTH RANK]

It trains the test transformer for STEP steps and saves ``RUN/step_<STEP>`` with ``keep=1``. With
a kill point, rank RANK wraps the function TARGET (a dotted path) so that its NTH call kills the
process with SIGKILL before (``WHEN=before``) or after (``WHEN=after``) the call, as a node dying
there would; torchrun then takes the other rank down.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys


def _resolve(dotted: str):
    """(owner, attribute) for ``package.module.Class.attr`` or ``package.module.attr``."""
    parts = dotted.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            owner = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:-1]:
            owner = getattr(owner, name)
        return owner, parts[-1]
    raise ImportError(dotted)


def arm(target: str, when: str, nth: int) -> None:
    owner, attr = _resolve(target)
    original = getattr(owner, attr)
    calls = [0]

    def wrapper(*args, **kwargs):
        calls[0] += 1
        if calls[0] == nth and when == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        out = original(*args, **kwargs)
        if calls[0] == nth and when == "after":
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    setattr(owner, attr, wrapper)


def main() -> None:
    import torch.distributed as dist

    import mfsdp_ckpt
    from mfsdp_core import fully_shard_optimizer
    from tests.mfsdp_core.models import make_adamw, make_model, shard_model, train_steps

    run, step = sys.argv[1], int(sys.argv[2])
    dist.init_process_group("gloo")
    if len(sys.argv) > 3:
        target, when, nth, rank = sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6])
        if dist.get_rank() == rank:
            arm(target, when, nth)
    model = shard_model(make_model("transformer"), strategy="optim_grads_params", policy="row")
    optim = fully_shard_optimizer(make_adamw(model.parameters()))
    train_steps(model, optim, 0, step)
    mfsdp_ckpt.save(os.path.join(run, f"step_{step}"), model, optim, extra={"step": step}, step=step, keep=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
