"""torchtitan both ways, against genuine torchtitan 0.3.0 (issue 64, items 3-4).

torchtitan's llama3 debugmodel, parallelised by its own ``parallelize_llama`` (FSDP2), trains 2
steps on 2 gloo ranks (AdamW, its LR scheduler, its dataloader, a train state) and saves with its
own ``CheckpointManager`` (``tests.titan.llama``). Then: we read it with no flags (``inspect``,
``verify``, ``diff``); ``reshard --to torchtitan`` lays it out for 3 ranks and torchtitan's own
``CheckpointManager.load`` at 3 ranks restores every entry bitwise; 3 -> 2 again restores the
dataloader too; a key map that would file the optimizer's and the trainer's state as model
weights is refused in one line; and our runtime, sharding torchtitan's own llama3 module, loads
the checkpoint through the module's state-dict hooks (the fused ``wqkv``) bitwise."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys

import pytest
import torch

from tests.harness import run_ranks
from tests.titan import llama
from tests.torchrun import ENV, ROOT

pytest.importorskip("torchtitan", reason="torchtitan is installed by the Makefile (--no-deps)")

pytestmark = pytest.mark.heavy

CLI = [sys.executable, "-m", "cli.main"]
STEP = 2  # steps trained before the save: torchtitan's folder is step-2
#: the debugmodel's checkpoint: 57 model entries (45 parameters, wqkv saved as wq/wk/wv), per
#: parameter 3 AdamW states and 12 hyper-parameters, and the trainer's 6 entries at 2 ranks
MODEL_ENTRIES, OPTIMIZER_ENTRIES, TRAINER_ENTRIES = 57, 45 * (3 + 12), 6


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def genuine(tmp_path_factory) -> dict:
    """torchtitan's own checkpoint at 2 ranks (``<run>/step-2``) and the state it saved."""
    run = str(tmp_path_factory.mktemp("titan") / "run")
    saved = run_ranks(llama.train_and_save, 2, run, STEP, timeout=300)[0]
    return {"run": run, "ckpt": os.path.join(run, f"step-{STEP}"), "saved": saved}


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _differing(saved: dict, loaded: dict) -> list[str]:
    return [k for k in saved if k not in loaded or not _same(saved[k], loaded[k])]


def _reshard_titan(src: str, dst: str, world_size: int) -> None:
    res = _cli("reshard", src, dst, "--world-size", str(world_size), "--to", "torchtitan", "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["entries"] == MODEL_ENTRIES + OPTIMIZER_ENTRIES + TRAINER_ENTRIES


def _metadata(path: str):
    with open(os.path.join(path, ".metadata"), "rb") as f:
        return pickle.load(f)  # the test's own checkpoint


def test_a_genuine_checkpoint_is_read_with_no_flags(genuine):
    ckpt, saved = genuine["ckpt"], genuine["saved"]
    res = _cli("inspect", ckpt, "--json")
    assert res.returncode == 0, res.stderr
    info = json.loads(res.stdout)
    assert info["format"] == "torchtitan" and info["step"] == STEP
    assert info["totals"]["model"]["tensors"] == MODEL_ENTRIES
    assert info["totals"]["optim"]["tensors"] == OPTIMIZER_ENTRIES
    assert info["totals"]["other"]["tensors"] == TRAINER_ENTRIES
    groups = {t["key"]: t["group"] for t in info["tensor_list"]}
    assert groups["layers.0.attention.qkv_linear.wq.weight"] == "model"
    assert groups["optimizer.state.layers.0.attention.qkv_linear.wqkv.weight.exp_avg"] == "optim"
    assert groups["optimizer.param_groups.norm.weight.lr"] == "optim"
    assert {k for k, g in groups.items() if g == "other"} == {
        "lr_scheduler.last_epoch",
        "train_state.step",
        "train_state.ntokens_seen",
        "dataloader.dp_rank_0",
        "dataloader.dp_rank_1",
        "dataloader.world_size",
    }
    text = _cli("inspect", ckpt).stdout
    assert "format      torchtitan (no mfsdp.json)" in text and "step        2" in text
    assert "[model]" in text and "[optim]" in text and "[other]" in text

    res = _cli("verify", ckpt)
    assert res.returncode == 0 and "checksums are not available" in res.stdout, res.stdout + res.stderr

    # the canonical names: the model, the optimizer's state by parameter, its groups, the trainer's
    from mfsdp_ckpt.read.mapped import MappedReader

    with MappedReader(ckpt) as reader:
        assert reader.titan
        keys = reader.keys()
        assert sum(k.startswith("model.") for k in keys) == MODEL_ENTRIES
        assert sum(k.startswith("optim.") and k != "optim.param_groups" for k in keys) == 45 * 3
        groups = reader.read("optim.param_groups")
        assert [len(g["params"]) for g in groups] == [45] and groups[0]["lr"] == saved["lr"][0]
        assert reader.read("train_state.step") == STEP


def test_a_key_map_filing_non_model_entries_as_weights_is_refused(genuine, tmp_path):
    ckpt, dst = genuine["ckpt"], str(tmp_path / "out")
    res = _cli("reshard", ckpt, dst, "--world-size", "3", "--key-map", "=model.", "--model-only")
    assert res.returncode == 1 and res.stderr.count("\n") == 1, res.stderr
    line = res.stderr
    assert "--key-map '=model.' would file 681 entries that are not model weights as model.*" in line
    assert "optimizer.* (675), dataloader.* (3), train_state.* (2), lr_scheduler.* (1)" in line
    assert "a torchtitan checkpoint is read without a key map" in line
    assert not os.path.exists(dst)
    res = _cli("diff", ckpt, ckpt, "--key-map-a", "=model.")
    assert res.returncode == 1 and res.stdout == "" and res.stderr.count("\n") == 1, res.stdout + res.stderr
    assert "would file 681 entries" in res.stderr

    # without it, --model-only keeps the model alone and --dtype casts the weights alone
    res = _cli("reshard", ckpt, dst, "--world-size", "3", "--model-only", "--dtype", "bfloat16", "--json")
    assert res.returncode == 0, res.stderr
    assert len(json.loads(res.stdout)["dropped"]) == 45 * 3 + 1 + TRAINER_ENTRIES  # states, groups, trainer's
    stored = _metadata(dst).state_dict_metadata
    assert sorted(stored) == sorted(f"model.{k}" for k in _model_names(genuine["saved"]))
    assert {md.properties.dtype for md in stored.values()} == {torch.bfloat16}


def _model_names(saved: dict) -> list[str]:
    """The model's state-dict names among what :func:`tests.titan.llama.full_state` returns."""
    return [k for k in saved if k.split(".", 1)[0] in ("tok_embeddings", "layers", "norm", "lm_head")]


def test_reshard_to_torchtitan_loads_in_torchtitan_at_3_then_2_ranks(genuine, tmp_path):
    saved = genuine["saved"]
    w3, w2 = str(tmp_path / "w3"), str(tmp_path / "w2")
    _reshard_titan(genuine["ckpt"], os.path.join(w3, f"step-{STEP}"), 3)
    out = os.path.join(w3, f"step-{STEP}")
    assert sorted(n for n in os.listdir(out) if n.endswith(".distcp")) == [f"__{r}_0.distcp" for r in range(3)]
    md = _metadata(out)
    assert len(md.state_dict_metadata) == MODEL_ENTRIES + OPTIMIZER_ENTRIES + TRAINER_ENTRIES
    files = {(i.fqn, tuple(i.offset or ())): info.relative_path for i, info in md.storage_data.items()}
    for key in ("tok_embeddings.weight", "optimizer.state.layers.0.attention.qkv_linear.wqkv.weight.exp_avg"):
        rows = md.state_dict_metadata[key].size[0]
        assert [c.offsets[0] for c in md.state_dict_metadata[key].chunks] == [0, -(-rows // 3), 2 * -(-rows // 3)]
        assert [files[(key, tuple(c.offsets))] for c in md.state_dict_metadata[key].chunks] == [
            f"__{r}_0.distcp" for r in range(3)
        ]
    assert _cli("verify", out).returncode == 0
    res = _cli("diff", genuine["ckpt"], out)
    assert res.returncode == 0 and res.stdout.startswith("equal: "), res.stdout + res.stderr

    # torchtitan at 3 ranks: every parameter (under its state-dict names and as parameters, the
    # fused wqkv among them), all optimizer state and groups, the scheduler, the train state:
    # bitwise. Its dataloader refuses another data-parallel degree: left out of this load.
    loaded = run_ranks(llama.load, 3, w3, ("dataloader",), timeout=300)[0]
    assert _differing(saved, loaded) == ["next_batch"]
    assert sum(k.startswith("param.") for k in saved) == 45 and loaded["train_state"] == {"step": 2, "ntokens_seen": 64}

    # 3 -> 2: the dataloader's entries came along unchanged; torchtitan at 2 ranks resumes it too
    _reshard_titan(out, os.path.join(w2, f"step-{STEP}"), 2)
    loaded = run_ranks(llama.load, 2, w2, timeout=300)[0]
    assert _differing(saved, loaded) == []

    # convert --to torchtitan: the same layout at the source's world size (2, from its data files)
    converted = str(tmp_path / "converted")
    res = _cli("convert", genuine["ckpt"], converted, "--to", "torchtitan")
    assert res.returncode == 0, res.stderr
    assert sorted(n for n in os.listdir(converted) if n.endswith(".distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert set(_metadata(converted).state_dict_metadata) == set(_metadata(genuine["ckpt"]).state_dict_metadata)
    assert _cli("diff", genuine["ckpt"], converted).returncode == 0
    res = _cli("reshard", genuine["ckpt"], str(tmp_path / "x"), "--world-size", "3", "--to", "torchtitan", "--ep", "1")
    assert (
        res.returncode == 1 and res.stderr.count("\n") == 1 and "--ep: does not apply to --to torchtitan" in res.stderr
    )


def _ours_through_hooks(path: str) -> dict:
    """torchtitan's own llama3 module (another seed), sharded by our runtime, loads ``path``
    plainly (refused: its one-line error) and then through the modules' state-dict hooks (what
    each rank then holds)."""
    import dataclasses

    import mfsdp_ckpt
    from mfsdp_ckpt.sharded.hooked import load_with_state_dict_hooks
    from mfsdp_core import describe_shards, fully_shard, fully_shard_optimizer

    llama.install_cpu_shims()
    from torchtitan.models.llama3 import model_registry

    spec = model_registry("debugmodel", attn_backend="flex")
    for layer in spec.model.layers:
        layer.attention.rope = dataclasses.replace(layer.attention.rope, max_seq_len=llama.SEQ_LEN)
    torch.manual_seed(5)
    model = spec.model.build()
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    for layer in model.layers.values():
        fully_shard(layer, strategy="optim_grads_params", policy="even")
    fully_shard(model, strategy="optim_grads_params", policy="even")
    optim = fully_shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    with pytest.raises(mfsdp_ckpt.CheckpointError) as e:
        mfsdp_ckpt.load(path, model, optim, require_manifest=False)
    load_with_state_dict_hooks(path, model, optim, require_manifest=False)
    out: dict = {"error": str(e.value), "lr": optim.param_groups[0]["lr"]}
    for ps in describe_shards(model, optim):
        lo, hi = ps.owned
        out[f"param.{ps.fqn}"] = (lo, hi, ps.main.tensor.clone())
        out.update((f"optimizer.state.{ps.fqn}.{k}", (lo, hi, fs.tensor.clone())) for k, fs in ps.optim.items())
        out.update((f"optimizer.state.{ps.fqn}.{k}", (0, 1, v.reshape(1).clone())) for k, v in ps.optim_extra.items())
    return out


def test_our_runtime_loads_torchtitans_llama3_through_its_state_dict_hooks(genuine):
    saved = genuine["saved"]
    per_rank = run_ranks(_ours_through_hooks, 3, genuine["ckpt"], timeout=300)
    keys = [k for k in per_rank[0] if k not in ("lr", "error")]
    assert len(keys) == 45 * 4  # every parameter, its exp_avg, exp_avg_sq and step
    assert sum(".wqkv." in k for k in keys) == 6 * 4
    for key in keys:
        full = saved[key].reshape(-1)
        assert all(torch.equal(full[lo:hi], values) for lo, hi, values in (r[key] for r in per_rank)), key
    assert per_rank[0]["lr"] == saved["lr"][0]

    # without the hooks (the load before): the fused parameters are missing, refused in one line
    error = per_rank[0]["error"]
    assert "\n" not in error and "missing from the checkpoint" in error and ".wqkv.weight" in error
