"""The meta-device model the bridges build for a checkpoint's shape."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from mfsdp_ckpt.model import shape as model_shape
from mfsdp_ckpt.model.shape import meta_model
from mfsdp_core.models.config import PRESETS
from mfsdp_core.models.gpt import GPTModel

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_meta_model_has_the_shapes_of_the_real_model():
    shape = PRESETS["tiny-deepseek"]
    meta = meta_model(shape)
    real = GPTModel(shape)
    assert [(n, p.shape, p.dtype) for n, p in meta.named_parameters()] == [
        (n, p.shape, p.dtype) for n, p in real.named_parameters()
    ]
    assert all(p.is_meta for p in meta.parameters())


def test_building_it_does_not_import_dynamo():
    """Random initialisation of meta tensors (values nobody reads) would import ``torch._dynamo``
    on its first call: 0.6 s of every HF export and import."""
    code = (
        "import sys\n"
        "from mfsdp_ckpt.model.shape import meta_model\n"
        "from mfsdp_core.models.config import PRESETS\n"
        "meta_model(PRESETS['tiny'])\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_the_skip_ends_with_the_build(monkeypatch):
    """The mode that skips meta init is gone once the model is built (also after a failed build):
    a meta tensor initialised afterwards goes through torch, not through the skip."""
    meta_model(PRESETS["tiny"])
    assert torch.overrides._get_current_function_mode_stack() == []

    def failing_build(shape):
        assert torch.overrides._get_current_function_mode_stack()  # the skip is active while building
        raise RuntimeError("build failed")

    monkeypatch.setattr(model_shape, "ShapeModel", failing_build)
    with pytest.raises(RuntimeError, match="build failed"):
        model_shape.meta_model(PRESETS["tiny"])
    assert torch.overrides._get_current_function_mode_stack() == []
