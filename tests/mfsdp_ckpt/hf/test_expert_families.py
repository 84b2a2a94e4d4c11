"""The launcher refuses ``--hf-model DIR --ep N`` from config.json alone (no torch, no
transformers) by the tables of ``mfsdp_ckpt.hf.expert_families``: each table is checked here
against the installed transformers, and the launcher's words against the ranks' for the same
directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from cli.hf_source import HFSource
from mfsdp_ckpt.hf.expert_families import (
    DENSE_FAMILIES,
    FUSED_CLASSES,
    FUSED_LAYOUTS,
    launcher_ep_refusal,
)
from mfsdp_ckpt.hf.transformers_layout import is_fused_expert
from tests.hf_models import make_hf_dir

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_the_tables_name_transformers_own_causal_lm_classes():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    assert set(FUSED_CLASSES) == set(FUSED_LAYOUTS)
    for model_type, name in {**FUSED_CLASSES, **DENSE_FAMILIES}.items():
        assert MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type] == name, model_type


@pytest.mark.parametrize("model_type", sorted(DENSE_FAMILIES))
def test_a_dense_family_declares_no_experts_by_default(model_type):
    from transformers import CONFIG_MAPPING

    config = CONFIG_MAPPING[model_type]()
    assert not getattr(config, "num_local_experts", None) and not getattr(config, "num_experts", None)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_a_fused_family_builds_fused_experts(family):
    import torch
    from transformers import AutoModelForCausalLM

    from tests.hf_models import hf_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config(family))
    assert any(is_fused_expert(n, tuple(p.shape)) for n, p in model.named_parameters())


@pytest.mark.parametrize("family", ["llama", "qwen3", "mixtral", "qwen3_moe"])
def test_the_launcher_and_the_ranks_refuse_alike(tmp_path, family):
    path = make_hf_dir(tmp_path / family, family, weights=False)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    ours = launcher_ep_refusal(config, 2)
    with pytest.raises(ValueError) as ranks:
        HFSource.from_dir(path).check_parallel(2, 2)
    assert ours == str(ranks.value)
    assert launcher_ep_refusal(config, 1) is None


def test_what_the_config_does_not_decide_is_left_to_the_ranks():
    # another class than the family's, experts declared in a dense family, an unknown family
    assert launcher_ep_refusal({"model_type": "mixtral", "architectures": ["MyMixtral"]}, 2) is None
    assert launcher_ep_refusal({"model_type": "llama", "num_experts": 4}, 2) is None
    assert launcher_ep_refusal({"model_type": "deepseek_v3"}, 2) is None
    assert launcher_ep_refusal({"architectures": ["LlamaForCausalLM"]}, 2) is None
    assert launcher_ep_refusal({"model_type": "llama"}, 2) == "EP size 2 needs a model with experts; this one has none"


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_the_launcher_refuses_before_importing_torch(tmp_path, family):
    path = make_hf_dir(tmp_path / family, family, weights=False)
    probe = (
        "import sys, cli.train\n"
        "cli.train.launch = lambda *a, **k: sys.exit('a rank was launched')\n"
        "code = cli.train.main(sys.argv[1:])\n"
        "print('TORCH=' + str('torch' in sys.modules), file=sys.stderr)\n"
        "sys.exit(code)\n"
    )
    argv = ["--nproc-per-node", "2", "--hf-model", path, "--ep", "2", "--ckpt-dir", str(tmp_path / "ck")]
    out = subprocess.run([sys.executable, "-c", probe, *argv], cwd=ROOT, capture_output=True, text=True, timeout=300)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1, out.stderr
    assert lines[-1] == "TORCH=False", out.stderr
    assert lines[-2].startswith("error: --ep 2: "), out.stderr
    assert not (tmp_path / "ck").exists()
