"""``cli.train --mcore-config``: a genuine Megatron-Core ``GPTModel`` (MoE, EP 2) trained by the
trainer on 2 ranks, stopped, resumed on 1 rank from the recorded model source alone; the resumed
losses equal an uninterrupted 1-rank run's; the checkpoint is canonical (``export-mcore`` and
``export-hf`` take it). Without megatron-core, ``--mcore-config`` is refused in one line naming
the extra."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mfsdp_ckpt.read.manifest import read_manifest
from tests.torchrun import ENV, ROOT, failure, read_metrics, run_train

ARGS = {
    "num_layers": 2,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "num_query_groups": 2,
    "ffn_hidden_size": 64,
    "vocab_size": 64,
    "seq_length": 32,
    "num_experts": 4,
    "moe_router_topk": 2,
    "moe_ffn_hidden_size": 32,
}
COMMON = ("--steps", "4", "--batch-size", "4", "--seq-len", "16", "--log-every", "10")


def _stop_at_2_on_2_ranks_then_resume_on_1(tmp_path, *options: str):
    """The MoE model trained with EP 2 on 2 ranks to step 2 (a checkpoint), then resumed on 1 rank
    from the record alone to step 4; returns (config file, checkpoint directory, the 2-rank run)."""
    config = tmp_path / "gpt.json"
    config.write_text(json.dumps(ARGS))  # every linear has whole 32-element blocks (for --mxfp8)
    ckpt = tmp_path / "ckpt"
    run = run_train(
        2,
        "--mcore-config",
        str(config),
        "--ep",
        "2",
        *options,
        *COMMON,
        "--stop-at",
        "2",
        "--ckpt-dir",
        str(ckpt),
        "--save-every",
        "2",
        "--metrics",
        str(tmp_path / "a.jsonl"),
    )
    assert run.returncode == 0, failure(run)
    resumed = run_train(
        1, *options, *COMMON, "--ckpt-dir", str(ckpt), "--resume", "--metrics", str(tmp_path / "b.jsonl")
    )
    assert resumed.returncode == 0, failure(resumed)
    assert "resumed from" in resumed.stdout and "finished: step 4 of 4" in resumed.stdout
    return config, ckpt, run


@pytest.mark.heavy
def test_mcore_moe_trains_resumes_at_another_world_size_and_exports(tmp_path):
    config, ckpt, run = _stop_at_2_on_2_ranks_then_resume_on_1(tmp_path)
    whole = tmp_path / "whole.jsonl"
    assert "model gpt.json (megatron-core), 33,184 parameters, world size 2, EP 2" in run.stdout
    manifest = read_manifest(str(ckpt / "step_000002"))
    assert manifest["model_source"]["kind"] == "megatron-core" and manifest["model_source"]["args"] == ARGS
    assert manifest["model_config"]["num_experts"] == 4
    straight = run_train(1, "--mcore-config", str(config), *COMMON, "--metrics", str(whole))
    assert straight.returncode == 0, failure(straight)
    got = {**read_metrics(tmp_path / "a.jsonl"), **read_metrics(tmp_path / "b.jsonl")}
    want = read_metrics(whole)
    assert sorted(got) == sorted(want) == [1, 2, 3, 4]
    for step in want:  # 2 ranks (EP 2) then 1 rank vs 1 rank: summation order only
        assert abs(got[step]["loss"] - want[step]["loss"]) <= 1e-5 * abs(want[step]["loss"]), (
            step,
            got[step],
            want[step],
        )
    for cmd in (
        ["export-mcore", str(ckpt / "latest"), str(tmp_path / "mc")],
        ["export-hf", str(ckpt / "latest"), str(tmp_path / "hf"), "--arch", "mixtral"],
    ):
        out = subprocess.run(
            [sys.executable, "-m", "cli.main", *cmd], cwd=ROOT, env=ENV, capture_output=True, text=True
        )
        assert out.returncode == 0, out.stderr


def test_mcore_config_without_megatron_core_is_refused_in_one_line(tmp_path):
    config = tmp_path / "gpt.json"
    config.write_text(json.dumps(ARGS))
    code = (
        "import sys; sys.modules['megatron'] = None; from cli.train import main; "
        f"sys.exit(main(['--mcore-config', {str(config)!r}, '--steps', '1', '--ckpt-dir', {str(tmp_path / 'ck')!r}]))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True, text=True)
    assert out.returncode == 1, out.stderr
    assert out.stderr.strip() == (
        f"error: --mcore-config {config}: megatron-core is not installed (pip install 'mfsdp-ckpt[mcore]')"
    ), out.stderr
    assert not (tmp_path / "ck").exists()


# ---- a trained MCore model's exports: export-mcore into MCore itself, export-hf into transformers ------------------

#: model -> (its MCore arguments, the trainer's ranks (None: one plain process) and extra flags, export-hf's
#: --arch); both tied (MCore's default)
KINDS = {
    "dense": ({k: v for k, v in ARGS.items() if not k.startswith(("num_experts", "moe_"))}, None, (), "llama"),
    "moe_ep2": (ARGS, 2, ("--ep", "2"), "mixtral"),
}
#: tokens of the logit comparison (seq 16 <= seq_length 32; the vocabulary is ARGS')
TOKENS_SEED, BATCH, SEQ = 1234, 2, 16
#: the freshly built MCore model's seed: other weights than the trained ones until the load
FRESH_SEED = 99
#: max |MCore - transformers| / max |transformers| over the logits (fp32)
LOGIT_RTOL = 1e-4


def _tokens():
    import torch

    return torch.randint(0, ARGS["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(TOKENS_SEED))


def _distributed_optimizer_request(model, request) -> dict:
    """What MCore's distributed optimizer asks ``dist_checkpointing.load`` for with sharding type
    ``fully_reshardable`` (``DistributedOptimizer.sharded_param_state_fully_reshardable`` with
    ``is_loading``): per parameter, its model ``ShardedTensor`` (or factory) found by identity,
    renamed ``optimizer.state.<state>.<key>``, fp32, for ``param`` (the main params),
    ``exp_avg``, ``exp_avg_sq``; keyed here by parameter name. (The optimizer itself cannot be
    built on CPU: its constructor asserts CUDA tensors.)"""
    from dataclasses import replace

    import torch
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

    tensors, _ = extract_sharded_tensors_and_factories(request)
    by_data = {id(sh.data): sh for sh in nested_values(tensors)}
    state = {}
    for name, param in model.named_parameters():
        sh = by_data[id(param)]
        state[name] = {}
        for kind in ("param", "exp_avg", "exp_avg_sq"):
            kwargs = dict(key=f"optimizer.state.{kind}.{sh.key}", data=torch.empty_like(param, dtype=torch.float32))
            if not isinstance(sh, ShardedTensorFactory):
                kwargs["dtype"] = torch.float32
            state[name][kind] = replace(sh, **kwargs)
    return {"param_state": state}


def _megatron_load_and_logits(jobs: list[tuple[str, str, str]]) -> None:
    """Run in a process of its own (MCore on CPU patches ``torch.cuda`` and starts a gloo group);
    for each ``(config, mcore_dir, out)``: build a fresh MCore ``GPTModel`` of ``config`` as the
    trainer builds it (local spec, EP 1, seed FRESH_SEED), load ``mcore_dir`` into it with
    ``megatron.core.dist_checkpointing.load``, the model's sharded state under ``"model"`` and the
    distributed optimizer's under ``"optimizer"`` (:func:`_distributed_optimizer_request`) as
    Megatron-LM's trainer asks for them (mismatched keys returned, not ignored), then
    ``load_state_dict(strict=True)``; save to ``out`` the fp32 logits before and after the load,
    the keys asked for, the mismatches, the common state's keys, the loaded optimizer tensors by
    parameter name, and the optimizer's common state (sharding type, param groups)."""

    import torch
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedObject
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.validation import StrictHandling

    from cli.mcore_source import McoreSource
    from mfsdp_core.models import mcore

    for config, mcore_dir, out in jobs:
        model = McoreSource.from_file(config).build(FRESH_SEED, None, micro_batches=1).eval()
        tokens = _tokens()
        with torch.no_grad():
            before = mcore.forward(model, tokens)[0]
        request = model.sharded_state_dict()
        asked = {v.key: isinstance(v, ShardedObject) for v in nested_values(request) if hasattr(v, "key")}
        optimizer = _distributed_optimizer_request(model, request)
        ours = mcore.canonical_names(model)  # MCore's parameter names -> the trainer's checkpoint names
        state, missing, unexpected = dist_checkpointing.load(
            {"model": request, "optimizer": optimizer}, mcore_dir, strict=StrictHandling.RETURN_ALL
        )
        model.load_state_dict(state["model"], strict=True)
        with torch.no_grad():
            after = mcore.forward(model, tokens)[0]
        torch.save(
            {
                "tokens": tokens,
                "before": before,
                "logits": after,
                "missing": sorted(missing),
                "unexpected": sorted(unexpected),
                "common": sorted(k for k in state if k != "model"),
                "optimizer": {ours[n]: v for n, v in state["optimizer"]["param_state"].items()},
                "sharding_type": state["optimizer"].get("param_state_sharding_type"),
                "param_groups": state["optimizer"].get("optimizer", {}).get("param_groups"),
                "tensors": sorted(k for k, obj in asked.items() if not obj),
                "objects": sorted(k for k, obj in asked.items() if obj),
            },
            out,
        )


@pytest.fixture(scope="module")
def mcore_exports(tmp_path_factory):
    """kind -> its directory: each of KINDS trained by the trainer (2 steps, saved at step 2; the
    MoE on 2 ranks with EP 2, the dense model on 1 to keep the time down), exported by the CLI
    (``mc/``: export-mcore, ``hf/``: export-hf), and what MCore made of ``mc/`` (``megatron.pt``:
    :func:`_megatron_load_and_logits`, one process for both)."""
    from click.testing import CliRunner

    from cli.main import main

    dirs, jobs = {}, []
    for kind, (args, nproc, extra, arch) in KINDS.items():
        d = dirs[kind] = tmp_path_factory.mktemp(kind)
        (d / "gpt.json").write_text(json.dumps(args))
        run = run_train(
            nproc,
            "--mcore-config",
            str(d / "gpt.json"),
            *extra,
            "--steps",
            "2",
            "--batch-size",
            "4",
            "--seq-len",
            "16",
            "--log-every",
            "10",
            "--save-every",
            "2",
            "--ckpt-dir",
            str(d / "ckpt"),
        )
        assert run.returncode == 0, failure(run)
        said = f"(megatron-core), {'33,184' if extra else '20,640'} parameters, world size {nproc or 1}"
        assert said + (", EP 2" if extra else ", strategy") in run.stdout, run.stdout
        # the trained model is MCore's local spec, which names the MoE pre-MLP norm mlp.linear_fc1.layer_norm_weight
        norm = ["--moe-norm", "local"] if extra else []
        for cmd in (
            ["export-mcore", str(d / "ckpt" / "latest"), str(d / "mc"), *norm],
            ["export-hf", str(d / "ckpt" / "latest"), str(d / "hf"), "--arch", arch],
        ):
            res = CliRunner().invoke(main, cmd)
            assert res.exit_code == 0, (cmd, res.output, res.exception)
        jobs.append((str(d / "gpt.json"), str(d / "mc"), str(d / "megatron.pt")))
    code = f"from tests.cli.test_train_mcore import _megatron_load_and_logits as f; f({jobs!r})"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return dirs


@pytest.mark.heavy  # slow (the inner loop's 8 minutes); CI runs it
@pytest.mark.parametrize("kind", list(KINDS))
def test_trained_mcore_checkpoint_loads_strictly_in_megatron_and_matches_transformers(kind, mcore_exports):
    """The trainer's checkpoint of a genuine MCore ``GPTModel`` (dense: 1 rank; MoE: 2 ranks with EP
    2; tied embeddings), through the CLI: ``export-mcore`` output loaded by MCore's own
    ``dist_checkpointing.load`` into a freshly built ``GPTModel`` (every key MCore asks for is
    there, and so is every optimizer tensor MCore's distributed optimizer asks for with sharding
    type ``fully_reshardable``; the checkpoint holds nothing else), whose logits equal those of
    ``transformers`` (fp32) on ``export-hf`` of the same checkpoint within LOGIT_RTOL of the
    largest logit. The optimizer state MCore loaded is the trained checkpoint's, bit for bit (the
    main params: the fp32 weights), and its common state is what the distributed optimizer's
    loader reads: the sharding type, and one step in param groups carrying MCore's group keys."""
    import torch
    from transformers import AutoModelForCausalLM

    d = mcore_exports[kind]
    assert read_manifest(str(d / "ckpt" / "step_000002"))["model_source"]["kind"] == "megatron-core"
    got = torch.load(d / "megatron.pt", weights_only=True)
    assert got["unexpected"] == [], got["unexpected"]  # MCore asked for nothing the export lacks
    assert got["objects"]  # the _extra_state objects, found (no unexpected key)
    assert "embedding.word_embeddings.weight" in got["tensors"] and "output_layer.weight" not in got["tensors"]  # tied
    if KINDS[kind][2]:
        experts = {"decoder.layers.mlp.experts.experts.linear_fc1.weight", "decoder.layers.mlp.router.weight"}
        assert experts <= set(got["tensors"]), got["tensors"]
    assert got["missing"] == [], got["missing"]  # the model's and the optimizer's state: nothing unasked for
    assert got["common"] == ["data_position", "iteration", "optimizer", "step"], got["common"]
    _check_optimizer_loaded_by_megatron(got, str(d / "ckpt" / "step_000002"))

    hf = AutoModelForCausalLM.from_pretrained(str(d / "hf"), dtype=torch.float32).eval()
    assert hf.config.tie_word_embeddings and all(p.dtype == torch.float32 for p in hf.parameters())
    with torch.no_grad():
        theirs = hf(got["tokens"]).logits
    assert got["logits"].shape == theirs.shape == (BATCH, SEQ, ARGS["vocab_size"])
    scale = theirs.abs().max().item()
    rel = (got["logits"] - theirs).abs().max().item() / scale
    moved = (got["before"] - got["logits"]).abs().max().item() / scale
    print(
        f"\n{kind}: MCore (export-mcore, dist_checkpointing.load) vs transformers (export-hf) logits: max |diff| / "
        f"max |logit| = {rel:.3g} (max |logit| {scale:.3g}); the fresh model before the load: {moved:.3g}"
    )
    assert rel <= LOGIT_RTOL, rel
    assert moved > 1e-2, moved  # the load replaced the fresh model's weights: the trained ones are compared


def _check_optimizer_loaded_by_megatron(got: dict, ckpt: str) -> None:
    """What MCore loaded for its distributed optimizer (``got``: see :func:`_megatron_load_and_logits`)
    against the trained checkpoint ``ckpt`` (by the trainer's names of the parameters): every
    parameter's ``exp_avg`` / ``exp_avg_sq`` bitwise equal to ours, its ``param`` equal to our
    fp32 weights; the sharding type and one step (2) in param groups carrying MCore's
    ``param_group_identifier_keys``."""
    import torch

    from mfsdp_ckpt.read.mapped import MappedReader

    identifiers = ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr")  # MCore 0.16.1's
    assert got["sharding_type"] == "fully_reshardable", got["sharding_type"]
    assert {g["step"] for g in got["param_groups"]} == {2}, got["param_groups"]
    assert all(k in g for g in got["param_groups"] for k in identifiers), got["param_groups"]
    with MappedReader(ckpt) as ours:
        for fqn, states in got["optimizer"].items():
            assert torch.equal(states["param"], ours.read(f"model.{fqn}")), fqn
            for kind in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(states[kind], ours.read(f"optim.{fqn}.{kind}")), (fqn, kind)
        assert len(got["optimizer"]) == len([k for k in ours.keys() if k.endswith(".exp_avg")])


@pytest.mark.heavy
@pytest.mark.parametrize(
    "options", [("--mxfp8",), ("--optimizer", "muon", "--policy", "tensor")], ids=["mxfp8", "muon"]
)
def test_mcore_moe_with_mxfp8_or_muon_resumes_at_another_world_size(options, tmp_path):
    _, ckpt, _ = _stop_at_2_on_2_ranks_then_resume_on_1(tmp_path, *options)
    if options == ("--mxfp8",):  # MX planes for MCore's linears (attention, dense MLP, each expert), under our names
        from mfsdp_ckpt.read.reader import CheckpointReader

        with CheckpointReader(str(ckpt / "step_000004")) as reader:
            mx = {k[len("mx.") :].rsplit(".", 1)[0] for k in reader.keys() if k.startswith("mx.")}
        assert mx and all(".linear_" in fqn for fqn in mx), sorted(mx)
        assert any(".experts." in fqn for fqn in mx) and any("self_attention.linear_qkv" in fqn for fqn in mx), sorted(
            mx
        )
