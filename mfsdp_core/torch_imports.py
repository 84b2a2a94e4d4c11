"""Two torch imports done at the right moment, so that no process group outlives
``destroy_process_group()``.

A gloo group's worker threads stop only when its last reference goes. Left running into
interpreter shutdown, one that finishes a collective there needs the GIL to release its tensors
and aborts the process (SIGABRT, "terminate called without an active exception") after the job
has done its work. Two imports inside torch keep a group referenced when they happen late:

- ``torch.distributed.nn.functional`` gives its functions the default argument
  ``group=group.WORLD``, evaluated when the module is imported: imported once a default group
  exists, those defaults hold it for the rest of the process. DCP and ``torch._dynamo`` import
  it lazily (the first save or load, the first optimizer), usually after
  ``init_process_group``. It is imported here, with this module, which ``fully_shard``'s module
  imports: before any group exists when a script takes the runtime's names first
  (``from mfsdp_core import fully_shard``; the packages themselves load their names on first
  use), 2 ms.
- ``torch._dynamo`` is imported the first time a process calls an optimizer method that torch
  wraps (``Optimizer.__init__`` → ``add_param_group``). During that import ``torch.fx.wrap``
  keeps its own frame in a local variable: a reference cycle that holds every frame up the stack
  at that moment, with their locals, until the garbage collector runs; the caller's frames then
  keep the first model and optimizer, and the group their buffers hold, alive past the caller's
  return. :func:`import_dynamo_off_the_stack` imports it from a thread of its own, whose frames
  are all that cycle can hold; ``fully_shard`` calls it, before the caller builds an optimizer.
"""

from __future__ import annotations

import importlib
import sys
import threading

import torch.distributed.nn.functional  # noqa: F401 - imported before any process group (see above)

__all__ = ["import_dynamo_off_the_stack"]

_DYNAMO = "torch._dynamo"


def import_dynamo_off_the_stack() -> None:
    """Import ``torch._dynamo`` in a short-lived thread, once per process (a no-op once it is
    loaded). An import that fails there is left to the optimizer's own import to raise."""
    if _DYNAMO in sys.modules:
        return
    thread = threading.Thread(target=_import, name="mfsdp-import-dynamo", daemon=True)
    thread.start()
    thread.join()


def _import() -> None:
    try:
        importlib.import_module(_DYNAMO)
    except Exception:  # noqa: BLE001 - the caller's own import (in torch) raises it where it matters
        pass
