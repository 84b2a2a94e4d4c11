"""``mfsdp-ckpt upcycle``: a dense checkpoint (a Llama imported with ``import-hf``) becomes an MoE
checkpoint that computes the same function. ``transformers``' Mixtral on the ``export-hf`` of the
result gives the Llama's logits (fp32, 1e-5), whole copies and granular slices alike (and
Qwen3-MoE a Qwen3's); the trainer starts from it on 2 ranks with the Llama's loss; sources of any
layout (resharded, a bf16 model with fp32 main params and optimizer state, on S3) give the same
result; every refusal is one line naming the source, with nothing at the destination."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner

pytest.importorskip("transformers")

from cli.main import main
from mfsdp_ckpt.format.keys import MAIN_PARAM, model_key, optim_key
from mfsdp_ckpt.format.manifest import versions, writer_layout
from mfsdp_ckpt.read.reader import CheckpointReader
from mfsdp_ckpt.tools.diff import diff_checkpoints
from mfsdp_ckpt.tools.upcycle import upcycle
from mfsdp_ckpt.write.builder import CheckpointBuilder
from mfsdp_core import ModelPlan
from mfsdp_core.data import SyntheticText
from tests.mfsdp_ckpt.hf.util import VOCAB, hf_config, random_hf_model, reference_model, save_hf, tokens
from tests.torchrun import failure, read_metrics, run_train

LOGIT_ATOL = 1e-5  # fp32, same math in another operation order (docs/hf.md)
FFN = 48  # hf_config's intermediate_size


def _cli(*args: str):
    return CliRunner().invoke(main, list(args))


def _ok(*args: str) -> dict:
    result = _cli(*args, "--json")
    assert result.exit_code == 0, (args, result.output, result.exception)
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> tuple[torch.nn.Module, str]:
    """A random Llama (fp32) and its ``import-hf`` checkpoint."""
    tmp = tmp_path_factory.mktemp("upcycle")
    llama = random_hf_model(hf_config("llama"))
    _ok("import-hf", save_hf(llama, str(tmp / "hf")), str(tmp / "dense"))
    return llama, str(tmp / "dense")


@pytest.fixture(scope="module")
def upcycled(dense, tmp_path_factory) -> str:
    """``dense`` upcycled to 4 experts, top-2."""
    out = str(tmp_path_factory.mktemp("moe") / "moe")
    _ok("upcycle", dense[1], out, "--num-experts", "4", "--topk", "2")
    return out


def _manifest(path: str) -> dict:
    with open(os.path.join(path, "mfsdp.json")) as f:
        return json.load(f)


def _hf_error(dense: torch.nn.Module, ckpt: str, out: str, architecture: str = "mixtral") -> float:
    """Max |logits of the ``export-hf`` of ``ckpt`` - ``dense``'s logits| on random tokens, the
    export loaded by ``transformers`` (checked to be ``architecture``)."""
    from transformers import AutoModelForCausalLM

    exported = _ok("export-hf", ckpt, out)
    assert exported["architecture"] == architecture
    moe = AutoModelForCausalLM.from_pretrained(out).eval()
    x = tokens(batch=3, seq=32, seed=7)
    with torch.no_grad():
        return (moe(x).logits - dense(x).logits).abs().max().item()


@pytest.mark.parametrize("experts,topk,granularity", [(4, 2, 1), (8, 4, 2), (6, 3, 3)])
def test_the_upcycled_model_computes_the_dense_function(dense, tmp_path, experts, topk, granularity):
    llama, src = dense
    out = str(tmp_path / "moe")
    doc = _ok(
        "upcycle", src, out, "--num-experts", str(experts), "--topk", str(topk), "--granularity", str(granularity)
    )
    config = doc["model_config"]
    assert doc["path"] == out and doc["tensors"] == 2 * (2 * experts + 5) + 3 and doc["dropped"] == []
    assert (config["num_experts"], config["moe_router_topk"]) == (experts, topk)
    assert (config["moe_ffn_hidden_size"], config["ffn_hidden_size"]) == (FFN // granularity, FFN)
    assert config["moe_score_func"] == "softmax" and not config["moe_router_pre_softmax"]
    assert config["moe_shared_expert_ffn_hidden_size"] == 0
    verified = _cli("verify", out)
    assert verified.exit_code == 0 and verified.stdout.strip() == f"ok: {out}", verified.output

    manifest = _manifest(out)
    assert manifest["model_source"] == {"kind": "mfsdp-gpt", "config": config}
    assert "hf" not in manifest  # a Llama record no longer describes the model: export-hf infers mixtral
    assert manifest["upcycled_from"]["path"] == src and manifest["upcycled_from"]["granularity"] == granularity
    assert ModelPlan.from_dict(manifest["writer"]["plan"]).buffers  # reshard lays it out from this

    assert _hf_error(llama, out, str(tmp_path / "hf")) <= LOGIT_ATOL
    with torch.no_grad():  # our reference model too
        x = tokens()
        assert (reference_model(out)(x) - llama(x).logits).abs().max().item() <= LOGIT_ATOL


def test_a_tied_qwen3_becomes_a_qwen3_moe(tmp_path):
    """q/k norms and tied embeddings are copied as they are: export-hf infers Qwen3-MoE."""
    qwen = random_hf_model(hf_config("qwen3", tie_word_embeddings=True), seed=3)
    _ok("import-hf", save_hf(qwen, str(tmp_path / "hf")), str(tmp_path / "dense"))
    args = ("--num-experts", "4", "--topk", "2", "--granularity", "2")
    _ok("upcycle", str(tmp_path / "dense"), str(tmp_path / "moe"), *args)
    assert _hf_error(qwen, str(tmp_path / "moe"), str(tmp_path / "hf_moe"), "qwen3_moe") <= LOGIT_ATOL


def test_the_expert_weights_are_the_dense_slices_and_the_router_is_seeded(dense, tmp_path):
    src = dense[1]
    out = tmp_path / "g2"
    upcycle(src, out, num_experts=4, topk=2, granularity=2, seed=5)
    with CheckpointReader(src) as a, CheckpointReader(out) as b:
        prefix = "model.decoder.layers.1."
        fc1, fc2 = a.read(prefix + "mlp.linear_fc1.weight"), a.read(prefix + "mlp.linear_fc2.weight")
        gate, up = fc1.chunk(2)
        f = FFN // 2
        for e in range(4):
            s = e % 2
            want = torch.cat([gate[s * f : (s + 1) * f], up[s * f : (s + 1) * f]])
            assert torch.equal(b.read(f"{prefix}mlp.experts.linear_fc1.weight{e}"), want)
            assert torch.equal(b.read(f"{prefix}mlp.experts.linear_fc2.weight{e}"), fc2[:, s * f : (s + 1) * f] * 2)
        assert torch.equal(
            b.read(prefix + "pre_mlp_layernorm.weight"), a.read(prefix + "mlp.linear_fc1.layer_norm_weight")
        )
        router = b.read(prefix + "mlp.router.weight")
        assert torch.equal(router[0], router[1]) and torch.equal(router[2], router[3])  # one row per group
        assert not torch.equal(router[0], router[2]) and 0.01 < router.std().item() < 0.04
    again = tmp_path / "g2_again"
    upcycle(src, again, num_experts=4, topk=2, granularity=2, seed=5)
    assert diff_checkpoints(out, again).equal  # the seed decides the routers
    other = diff_checkpoints(out, upcycle(src, tmp_path / "seed6", num_experts=4, topk=2, granularity=2, seed=6).path)
    assert {d.key for d in other.different} == {f"model.decoder.layers.{i}.mlp.router.weight" for i in range(2)}


def test_granular_routing_must_pick_whole_groups(dense, tmp_path):
    """The control: the same granular weights with one router row of a group changed no longer
    compute the dense function (so the exactness above is not an accident of the weights)."""
    src = dense[1]
    model = reference_model(src)  # a dense GPTModel
    moe = reference_model(upcycle(src, tmp_path / "g2", num_experts=4, topk=2, granularity=2).path)
    x = tokens()
    with torch.no_grad():
        assert (moe(x) - model(x)).abs().max().item() <= LOGIT_ATOL
        for layer in moe.decoder.layers:
            layer.mlp.router.weight[1] = layer.mlp.router.weight[1] + torch.randn_like(layer.mlp.router.weight[1])
        assert (moe(x) - model(x)).abs().max().item() > 1e-3


def _bf16_with_main_params(src: str, dst: str) -> None:
    """``src`` as a bf16 model's checkpoint would hold it: ``model.*`` in bf16, the fp32 weights
    as ``optim.<fqn>.main_param``, an Adam state and trainer state next to them."""
    with CheckpointReader(src) as reader:
        manifest = {**reader.manifest, "writer": writer_layout(1, ModelPlan({"dp": 1}, ())), "versions": versions()}
        with CheckpointBuilder(dst, {k: v for k, v in manifest.items() if k != "chunks"}) as builder:
            for key in reader.keys():
                weights = reader.read(key)
                name = key[len("model.") :]
                builder.add_tensor(key, weights.to(torch.bfloat16))
                builder.add_tensor(optim_key(name, MAIN_PARAM), weights)
                builder.add_tensor(optim_key(name, "exp_avg"), torch.zeros_like(weights))
            builder.add_object("extra.step", 7)
            builder.commit()


def test_any_layout_and_the_fp32_main_params_give_the_same_checkpoint(dense, upcycled, tmp_path):
    src = dense[1]
    _ok("reshard", src, str(tmp_path / "w3"), "--world-size", "3", "--policy", "row")
    doc = _ok("upcycle", str(tmp_path / "w3"), str(tmp_path / "from_w3"), "--num-experts", "4", "--topk", "2")
    assert diff_checkpoints(upcycled, doc["path"]).equal

    _bf16_with_main_params(src, str(tmp_path / "bf16"))
    doc = _ok("upcycle", str(tmp_path / "bf16"), str(tmp_path / "from_bf16"), "--num-experts", "4", "--topk", "2")
    assert diff_checkpoints(upcycled, doc["path"]).equal  # fp32 weights: the main params, as load reads them
    assert "extra.step" in doc["dropped"] and model_key("decoder.final_layernorm.weight") in doc["dropped"]
    assert optim_key("decoder.final_layernorm.weight", "exp_avg") in doc["dropped"]


def _refused(src: str, dst: str, *args: str, why: str) -> None:
    result = _cli("upcycle", src, dst, *args)
    assert result.exit_code == 1, result.output
    line = result.stderr
    assert line.count("\n") == 1 and line.startswith(f"error: {src}: ") and why in line, line
    assert not os.path.exists(dst) and not any(n.startswith(".") for n in os.listdir(os.path.dirname(dst)))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.save in one process, on purpose
def test_refusals_are_one_line_naming_the_source_and_leave_nothing(dense, upcycled, tmp_path):
    src = dense[1]
    dst = str(tmp_path / "out" / "moe")
    os.makedirs(os.path.dirname(dst))
    _refused(upcycled, dst, "--num-experts", "8", "--topk", "2", why="already an MoE model (num_experts=4)")
    _refused(src, dst, "--num-experts", "0", "--topk", "1", why="--num-experts 0: must be at least 1")
    _refused(src, dst, "--num-experts", "4", "--topk", "0", why="--topk 0: must be in [1, --num-experts 4]")
    _refused(src, dst, "--num-experts", "4", "--topk", "5", why="--topk 5: must be in [1, --num-experts 4]")
    _refused(src, dst, "--num-experts", "6", "--topk", "2", "--granularity", "3", why="--granularity 3 must divide")
    _refused(src, dst, "--num-experts", "5", "--topk", "5", "--granularity", "5", why="does not divide the FFN size")
    _refused(src, dst, "--num-experts", "4", "--topk", "2", "--granularity", "0", why="must be at least 1")

    import torch.distributed.checkpoint as dcp

    stock = str(tmp_path / "stock")
    dcp.save({"model.w": torch.ones(3)}, checkpoint_id=stock, no_dist=True)
    _refused(stock, dst, "--num-experts", "4", "--topk", "2", why="has no model_config")

    # an existing destination: refused without --overwrite (left as it was), replaced with it
    os.makedirs(dst)
    with open(os.path.join(dst, "keep"), "w") as f:
        f.write("x")
    result = _cli("upcycle", src, dst, "--num-experts", "4", "--topk", "2")
    assert result.exit_code == 1 and "already exists" in result.stderr and result.stderr.count("\n") == 1
    assert os.listdir(dst) == ["keep"]
    os.remove(os.path.join(dst, "keep"))
    assert _cli("upcycle", src, dst, "--num-experts", "4", "--topk", "2", "--overwrite").exit_code == 0
    assert diff_checkpoints(upcycled, dst).equal


def test_text_output_and_s3_on_both_sides(dense, s3_bucket, tmp_path):
    import fsspec

    src = dense[1]
    fsspec.filesystem("s3", skip_instance_cache=True).put(src, f"{s3_bucket}/dense", recursive=True)
    url = f"{s3_bucket}/moe"
    result = _cli("upcycle", f"{s3_bucket}/dense", url, "--num-experts", "2", "--topk", "1")
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(f"wrote {url}: 2 experts, top-1, 21 tensors, ") and "of data files" in result.stdout
    assert _cli("verify", url).exit_code == 0
    upcycle(src, tmp_path / "local", num_experts=2, topk=1)
    assert diff_checkpoints(url, tmp_path / "local").equal
    refused = _cli("upcycle", url, str(tmp_path / "again"), "--num-experts", "4", "--topk", "2")
    assert refused.exit_code == 1 and refused.stderr == f"error: {url}: already an MoE model (num_experts=2); " + (
        "upcycle takes a dense checkpoint\n"
    )


@pytest.mark.heavy  # slow (the inner loop's 8 minutes); CI runs it
def test_trains_from_the_upcycled_checkpoint_on_2_ranks(dense, upcycled, tmp_path):
    """``mfsdp-train --init-from`` builds the MoE model the manifest records; step 1's loss (before
    any update) is the dense Llama's loss on the same batch, and training goes on."""
    llama = dense[0]
    run = run_train(
        2,
        "--init-from",
        upcycled,
        "--steps",
        "3",
        "--batch-size",
        "2",
        "--seq-len",
        "32",
        "--metrics",
        str(tmp_path / "m.jsonl"),
        "--ckpt-dir",
        str(tmp_path / "run"),
    )
    assert run.returncode == 0, failure(run)
    assert f"initialised from the weights of {upcycled}" in run.stdout
    losses = [r["loss"] for _, r in sorted(read_metrics(tmp_path / "m.jsonl").items())]
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)
    batch = SyntheticText(VOCAB, 32, seed=0).batch(0, 2)
    with torch.no_grad():
        logits = llama(batch[:, :-1]).logits
        expected = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)).item()
    assert abs(losses[0] - expected) <= 1e-5 * expected, (losses[0], expected)
    assert _manifest(str(tmp_path / "run" / "step_000003"))["model_config"]["num_experts"] == 4
