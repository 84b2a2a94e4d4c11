"""DeepSeek-V3 through the HF bridge and the trainer, against ``transformers`` (no network: the
models are built here from configs of the test's own shapes).

* A DeepSeek-format directory (transformers' ``DeepseekV3ForCausalLM`` saved, plus one MTP layer
  made by transformers' ``MtpModel`` and stored as DeepSeek releases it, after the decoder's
  layers with copies of the embedding and the head; random expert biases): ``import-hf`` then
  ``export-hf`` gives bitwise the same tensors under the same names; our forward equals
  transformers' (main logits and the MTP layer's logits) within 1e-5 (fp32: the same math in
  another operation order); YaRN RoPE, q compression and none, groups and no groups.
* 3 training steps from it (``--init-from``, ``--ep 2``, 2 ranks); the export loads in
  transformers with the trained router bias.
* A 4-rank, EP 2 checkpoint resharded offline to 1 rank without EP is bitwise the same, router
  bias included.
* A config whose ``n_group`` does not divide the experts: one line, exit 1.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

pytest.importorskip("transformers")

from cli.main import main
from mfsdp_ckpt import hf
from mfsdp_ckpt.read.reader import CheckpointReader
from mfsdp_core.models.mtp import shift_left
from tests.torchrun import failure, run_train

from .util import VOCAB, hf_tensors, random_hf_model, reference_model, save_hf, tokens

LOGIT_ATOL = 1e-5
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def deepseek_config(**overrides):
    import transformers as tf

    base = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=8,
        num_experts_per_tok=4,
        n_group=2,
        topk_group=2,
        n_shared_experts=2,
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=12,
        v_head_dim=10,
        max_position_embeddings=64,
        num_nextn_predict_layers=1,
    )
    return tf.DeepseekV3Config(**{**base, **overrides})


def _randomise_router_bias(*models) -> None:
    with torch.no_grad():
        for model in models:
            for name, b in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b.copy_(0.1 * torch.randn_like(b))


def _mtp_tensors(mtp, main, layer: int) -> dict[str, torch.Tensor]:
    """``MtpModel``'s weights under the names DeepSeek's checkpoints give them: MTP layer k's at
    ``model.layers.{num_hidden_layers + k}``, experts one by one, with copies of the embedding
    and of the output head."""
    out = {}
    for name, p in mtp.state_dict().items():
        if name.startswith(("embed_tokens", "shared_head")):
            continue  # the main model's, shared
        rest = name[len("layers.0.") :].replace("post_norm.", "shared_head.norm.").removeprefix("mtp_block.")
        prefix = f"model.layers.{layer}."
        if rest == "mlp.experts.gate_up_proj":
            half = p.shape[1] // 2
            for e in range(p.shape[0]):
                out[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = p[e, :half].clone()
                out[f"{prefix}mlp.experts.{e}.up_proj.weight"] = p[e, half:].clone()
        elif rest == "mlp.experts.down_proj":
            out.update({f"{prefix}mlp.experts.{e}.down_proj.weight": p[e].clone() for e in range(p.shape[0])})
        else:
            out[prefix + rest] = p.detach().clone()
    out[f"model.layers.{layer}.embed_tokens.weight"] = main.model.embed_tokens.weight.detach().clone()
    out[f"model.layers.{layer}.shared_head.head.weight"] = main.lm_head.weight.detach().clone()
    return out


def deepseek_dir(path: str, seed: int = 0, **overrides):
    """A DeepSeek-format HF directory with one MTP layer: ``(dir, main model, MtpModel)``."""
    from transformers.modeling_layers import MtpModel

    config = deepseek_config(**overrides)
    main_model = random_hf_model(config, seed=seed)
    mtp = MtpModel(main_model, 1)
    torch.manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in mtp.named_parameters():
            if not name.startswith(("embed_tokens", "shared_head")):
                p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    _randomise_router_bias(main_model, mtp)
    mtp.eval()
    save_hf(main_model, path, max_shard_size="40KB")
    extra = _mtp_tensors(mtp, main_model, config.num_hidden_layers)
    save_file(extra, os.path.join(path, "model-mtp.safetensors"), metadata={"format": "pt"})
    index_path = os.path.join(path, "model.safetensors.index.json")
    with open(index_path) as f:
        index = json.load(f)
    index["weight_map"].update(dict.fromkeys(extra, "model-mtp.safetensors"))
    with open(index_path, "w") as f:
        json.dump(index, f)
    return path, main_model, mtp


CASES = {
    "yarn-groups-qlora": dict(rope_parameters=YARN),
    "plain-rope-no-groups-no-qlora": dict(q_lora_rank=None, n_group=1, topk_group=1, num_experts_per_tok=2),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_import_export_bitwise_and_transformers_logits_with_mtp(case, tmp_path):
    src, main_model, mtp = deepseek_dir(str(tmp_path / "src"), seed=len(case), **CASES[case])
    assert hf.import_(src, tmp_path / "ckpt").architecture == "deepseek_v3"
    hf.export(tmp_path / "ckpt", tmp_path / "out")
    a, b = hf_tensors(src), hf_tensors(str(tmp_path / "out"))
    assert sorted(a) == sorted(b)
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key

    ours = reference_model(str(tmp_path / "ckpt"))
    assert ours.config.mtp_num_layers == 1 and ours.config.multi_latent_attention
    x = tokens(seq=24)
    with torch.no_grad():
        main_err = (ours(x) - main_model(x).logits).abs().max().item()
        hidden = main_model.model(x).last_hidden_state  # final-normed, as MTP takes it
        theirs = mtp._project_to_logits(
            mtp.forward_layer(0, hidden, torch.arange(x.shape[1])[None], None, input_ids=shift_left(x))
        )
        h = ours.decoder(ours.embedding(x))
        mtp_ours = ours.head(ours.mtp.layers[0](h, ours.embedding(shift_left(x))))
    assert main_err <= LOGIT_ATOL, main_err
    assert (mtp_ours - theirs).abs().max().item() <= LOGIT_ATOL


@pytest.mark.heavy
def test_trained_with_ep2_exports_with_the_router_bias_transformers_loads(tmp_path):
    from transformers import AutoModelForCausalLM

    src, _, _ = deepseek_dir(str(tmp_path / "src"))
    hf.import_(src, tmp_path / "imported")
    run = run_train(
        2,
        *("--init-from", str(tmp_path / "imported"), "--ep", "2", "--steps", "3"),
        *("--batch-size", "4", "--seq-len", "16", "--ckpt-dir", str(tmp_path / "run"), "--save-every", "3"),
    )
    assert run.returncode == 0, failure(run)
    hf.export(tmp_path / "run" / "latest", tmp_path / "out")
    with CheckpointReader(tmp_path / "run" / "latest") as reader:
        trained = reader.read("model.decoder.layers.1.mlp.router.expert_bias")
        mtp_bias = reader.read("model.mtp.layers.0.transformer_layer.mlp.router.expert_bias")
    with CheckpointReader(tmp_path / "imported") as reader:
        assert not torch.equal(trained, reader.read("model.decoder.layers.1.mlp.router.expert_bias"))  # it moved
    theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    assert torch.equal(theirs.model.layers[1].mlp.gate.e_score_correction_bias, trained)
    exported = hf_tensors(str(tmp_path / "out"))
    assert torch.equal(exported["model.layers.2.mlp.gate.e_score_correction_bias"], mtp_bias)  # the MTP layer's
    with torch.no_grad():
        logits = theirs(tokens()).logits
    assert torch.isfinite(logits).all()


@pytest.mark.heavy
def test_w4_ep2_checkpoint_reshards_offline_to_one_rank_bitwise(tmp_path):
    run = run_train(
        4,
        *("--model", "tiny-deepseek", "--ep", "2", "--steps", "2", "--batch-size", "4", "--seq-len", "16"),
        *("--ckpt-dir", str(tmp_path / "run"), "--save-every", "2"),
    )
    assert run.returncode == 0, failure(run)
    runner = CliRunner()
    src, dst = str(tmp_path / "run" / "latest"), str(tmp_path / "w1")
    done = runner.invoke(main, ["reshard", src, dst, "--world-size", "1", "--ep", "1"])
    assert done.exit_code == 0, done.output
    same = runner.invoke(main, ["diff", src, dst, "--json"])
    assert same.exit_code == 0, same.output
    with CheckpointReader(src) as a, CheckpointReader(dst) as b:
        keys = [k for k in a.keys() if k.startswith("model.")]
        assert sorted(keys) == sorted(k for k in b.keys() if k.startswith("model."))
        biases = [k for k in keys if k.endswith("router.expert_bias")]
        assert len(biases) == 3  # two MoE decoder layers and the MTP layer
        for key in keys:
            assert torch.equal(a.read(key), b.read(key)), key
        assert any(a.read(k).abs().sum() > 0 for k in biases)  # trained: the check compares values that moved


def test_n_group_not_dividing_the_experts_is_one_line(tmp_path):
    path = save_hf(random_hf_model(deepseek_config(num_nextn_predict_layers=0)), str(tmp_path / "src"))
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["n_group"] = 3
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    result = CliRunner().invoke(main, ["import-hf", path, str(tmp_path / "ckpt")])
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "n_group" in lines[0], result.output
    assert "moe_router_num_groups (3) must divide num_experts (8)" in lines[0]
    assert not os.path.exists(tmp_path / "ckpt")


def test_an_mtp_copy_of_the_embedding_that_differs_is_refused(tmp_path):
    from safetensors.torch import load_file

    src, _, _ = deepseek_dir(str(tmp_path / "src"))
    path = os.path.join(src, "model-mtp.safetensors")
    tensors = load_file(path)
    tensors["model.layers.2.embed_tokens.weight"][0, 0] += 1.0
    save_file(tensors, path, metadata={"format": "pt"})
    result = CliRunner().invoke(main, ["import-hf", src, str(tmp_path / "ckpt")])
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert (
        len(lines) == 1 and "'model.layers.2.embed_tokens.weight' differs from 'model.embed_tokens.weight'" in lines[0]
    )
    assert not os.path.exists(tmp_path / "ckpt")


def test_a_transformers_save_without_its_mtp_layer_imports_without_mtp(tmp_path):
    """transformers saves a DeepSeek-V3 model without MTP tensors while its config keeps
    ``num_nextn_predict_layers``: the import builds the model without MTP, and says so."""
    path = save_hf(random_hf_model(deepseek_config(num_nextn_predict_layers=1)), str(tmp_path / "src"))
    result = CliRunner().invoke(main, ["import-hf", path, str(tmp_path / "ckpt"), "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["model_config"]["mtp_num_layers"] == 0
    assert out["notes"] == [
        "config.json declares 1 multi-token-prediction layer(s), the files hold none of their tensors: "
        "imported without them"
    ]
