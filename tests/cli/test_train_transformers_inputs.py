"""``cli.train --hf-model`` refuses what it cannot train before anything is written: a path that is
not a model directory, a config.json that is not JSON or names an architecture transformers does
not know (or one that is not a causal LM), weights that disagree with the config, pickle weights,
and ``--ep`` for models whose experts are fused. One line naming the file and the field or
tensor, exit 1, no checkpoint directory."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import transformers

from cli.train import main
from tests.hf_models import make_hf_dir
from tests.torchrun import ENV, ROOT, run_train


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_hf_dir(tmp_path_factory.mktemp("llama") / "src", "llama")


def _refused(capsys, tmp_path, *args: str) -> str:
    ckpt = tmp_path / "ck"
    capsys.readouterr()  # what building the fixtures printed
    assert main([*args, "--steps", "1", "--ckpt-dir", str(ckpt)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert not ckpt.exists()
    return err[len("error: ") :]


def _copy(src: str, dst, edit=None) -> str:
    import shutil

    shutil.copytree(src, dst)
    if edit is not None:
        config = json.loads((dst / "config.json").read_text())
        edit(config)
        (dst / "config.json").write_text(json.dumps(config))
    return str(dst)


def test_not_a_directory(capsys, tmp_path):
    assert (
        _refused(capsys, tmp_path, "--hf-model", str(tmp_path / "nope"))
        == f"--hf-model {tmp_path / 'nope'}: not a directory"
    )


def test_a_directory_without_config_json(capsys, tmp_path):
    (tmp_path / "empty").mkdir()
    assert _refused(capsys, tmp_path, "--hf-model", str(tmp_path / "empty")) == (
        f"--hf-model {tmp_path / 'empty'}: no config.json (not a Hugging Face model directory)"
    )


def test_config_json_that_is_not_json(capsys, tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{nope")
    assert _refused(capsys, tmp_path, "--hf-model", str(tmp_path / "m")).startswith(
        f"{tmp_path / 'm' / 'config.json'}: not valid JSON"
    )


def test_unknown_architecture(capsys, tmp_path, llama):
    src = _copy(llama, tmp_path / "m", lambda c: c.update(model_type="nosuchmodel"))
    assert _refused(capsys, tmp_path, "--hf-model", src) == (
        f"{src}/config.json: model_type 'nosuchmodel' is not an architecture transformers {transformers.__version__} knows"
    )


def test_a_class_that_is_not_a_causal_lm(capsys, tmp_path, llama):
    src = _copy(llama, tmp_path / "m", lambda c: c.update(architectures=["LlamaForSequenceClassification"]))
    assert _refused(capsys, tmp_path, "--hf-model", src) == (
        f"{src}/config.json: architectures[0] 'LlamaForSequenceClassification' is not a causal LM (a …ForCausalLM class)"
    )


def test_config_whose_shapes_disagree_with_the_weights(capsys, tmp_path, llama):
    src = _copy(llama, tmp_path / "m", lambda c: c.update(intermediate_size=48))
    assert _refused(capsys, tmp_path, "--hf-model", src) == (
        f"{src}/model.safetensors: model.layers.0.mlp.gate_proj.weight is (40, 32), but {src}/config.json makes it "
        "(48, 32) (intermediate_size=48)"
    )


def test_config_with_more_layers_than_the_weights(capsys, tmp_path, llama):
    src = _copy(llama, tmp_path / "m", lambda c: c.update(num_hidden_layers=3))
    assert _refused(capsys, tmp_path, "--hf-model", src) == (
        f"{src}: the weights lack model.layers.2.input_layernorm.weight, model.layers.2.mlp.down_proj.weight, "
        f"model.layers.2.mlp.gate_proj.weight (+6 more), which {src}/config.json makes part of the model"
    )


def test_pickle_weights_are_not_read(capsys, tmp_path, llama):
    src = _copy(llama, tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").rename(tmp_path / "m" / "pytorch_model.bin")
    assert _refused(capsys, tmp_path, "--hf-model", src) == (
        f"{src}: its weights are pickle files (.bin/.pt); only safetensors weights are read (convert them with "
        "transformers' save_pretrained)"
    )


def test_expert_parallelism_of_fused_experts_is_refused(capsys, tmp_path, monkeypatch):
    # a world size --ep 2 divides: the flag rules, checked first, would refuse --ep 2 on 1 rank
    monkeypatch.setenv("WORLD_SIZE", "2")
    src = make_hf_dir(tmp_path / "mixtral", "mixtral")
    err = _refused(capsys, tmp_path, "--hf-model", src, "--ep", "2")
    assert err.startswith(
        "--ep 2: MixtralForCausalLM keeps each MoE layer's experts fused in 3-D parameters "
        "(mlp.experts.gate_up_proj, mlp.experts.down_proj)"
    ), err


def test_the_command_line_exits_1(tmp_path, llama):
    src = _copy(llama, tmp_path / "m", lambda c: c.update(hidden_size=48))
    run = subprocess.run(
        [sys.executable, "-m", "cli.train", "--hf-model", src, "--ckpt-dir", str(tmp_path / "ck")],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 1
    assert run.stderr.strip().splitlines()[-1].startswith(f"error: {src}/model.safetensors: "), run.stderr
    assert not (tmp_path / "ck").exists()


def test_a_directory_without_weights_trains_from_transformers_initialisation(tmp_path):
    from mfsdp_ckpt.read.manifest import read_manifest

    src = make_hf_dir(tmp_path / "m", "qwen3", weights=False)
    run = run_train(
        None,
        "--hf-model",
        src,
        "--steps",
        "1",
        "--batch-size",
        "2",
        "--seq-len",
        "8",
        "--ckpt-dir",
        str(tmp_path / "ck"),
    )
    assert run.returncode == 0, run.stderr
    assert "model m (transformers), " in run.stdout
    record = read_manifest(str(tmp_path / "ck" / "step_000001"))["model_source"]
    assert record["class"] == "Qwen3ForCausalLM"
    assert record["files"] == ["generation_config.json", "tokenizer.json", "tokenizer_config.json"]
