"""Third-party output a training run does not need, silenced at its source in each rank.

At default verbosity a run prints the trainer's own lines only; ``mfsdp-train --verbose`` leaves
everything below as the libraries set it. What each library prints, and where it comes from:

- **torchao** (imported by ``transformers``' quantizer registry when a model loads, so on every
  ``--hf-model`` run): ``Failed to load …/_C_mxfp8….so`` and ``…/_C_cutlass_90a.abi3.so`` (CUDA
  kernels on a CPU machine), ``logging`` warnings of the ``torchao`` logger; and two ``<enum
  'KernelPreference'> is an Enum subclass …`` lines when it registers its enums with torch's pytree,
  ``logging`` warnings of ``torch.utils._pytree``. Silenced: both loggers at ERROR.
- **Megatron-Core** (``--mcore-config``): "Transformer Engine and Apex are not installed. Falling
  back to …", "Apex is not installed. Falling back to Torch Norm", "full scope is deprecated …",
  ``warnings.warn`` calls in ``megatron.*`` (two lines each, per rank: about 30 lines). Silenced: a
  ``warnings`` filter on the modules that issue them, and the ``megatron`` logger at ERROR.
- **transformers / huggingface_hub**: advisory warnings and progress bars (``Loading weights``),
  through their own switches (``TRANSFORMERS_VERBOSITY``, ``HF_HUB_DISABLE_PROGRESS_BARS``,
  ``TRANSFORMERS_NO_ADVISORY_WARNINGS``, read when they are imported) and a ``warnings`` filter.

Nothing here touches an exception: a library that fails still raises, and the trainer reports it
as ever. Errors (``logging`` ERROR and above) still print. Only the named modules' warnings are
filtered, so the trainer's own warnings and those of torch called by our code still show. Importing
this module imports nothing but the standard library (the trainer's front end stays torch-free).
"""

from __future__ import annotations

import logging
import os
import warnings

__all__ = ["quiet_third_party", "QUIET_WARNING_MODULES", "QUIET_LOGGERS", "QUIET_ENV"]

#: the modules (a regular expression matched at the start of the warning's module name) whose
#: ``warnings.warn`` calls a run does not show; ``megatron`` covers ``megatron.core`` and the
#: ``megatron_fsdp`` package inside it
QUIET_WARNING_MODULES = r"(megatron|transformer_engine|apex|torchao|transformers|huggingface_hub)"
#: loggers set to ERROR: their warnings and infos are not ours
QUIET_LOGGERS = ("torchao", "torch.utils._pytree", "megatron", "transformers", "huggingface_hub")
#: the libraries' own switches, read when they are imported (a value the user set is kept)
QUIET_ENV = {
    "TRANSFORMERS_VERBOSITY": "error",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
}


def quiet_third_party(verbose: bool) -> None:
    """Silence the third-party output the module docstring lists, in this process, before the
    libraries are imported (their environment switches are read then); nothing when ``verbose``."""
    if verbose:
        return
    for name, value in QUIET_ENV.items():
        os.environ.setdefault(name, value)
    warnings.filterwarnings("ignore", module=QUIET_WARNING_MODULES)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
