"""import-mcore on synthetic MCore-layout checkpoints (plain ``dcp.save`` with MCore's key layout):
the optimizer layouts (a genuine distributed-optimizer checkpoint needs CUDA, see
fixtures/README.md), refusals of what cannot be carried (one line naming the key, exit 1,
nothing written), and the memory bound of reading stacked tensors."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

from mfsdp_ckpt.errors import ConversionError
from mfsdp_ckpt.mcore import import_mcore
from mfsdp_ckpt.mcore.import_ import plan_import
from mfsdp_ckpt.mcore.layout import stack_of
from mfsdp_ckpt.mcore.source import McoreSource
from mfsdp_ckpt.read.reader import CheckpointReader
from mfsdp_core.models.gpt import GPTConfig, GPTModel

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
DENSE = os.path.join(ROOT, "fixtures", "mcore", "dense")
HEADS = {"num_attention_heads": 4}
BACKEND = {
    "sharded_backend": "torch_dist",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}


def stacked_state(cfg: GPTConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Our random model's weights in MCore's stacked layout, one whole tensor per stored key."""
    torch.manual_seed(seed)
    model = GPTModel(cfg)
    groups: dict[str, dict[tuple[int, ...], torch.Tensor]] = {}
    for fqn, p in model.named_parameters():
        stored, index = stack_of(fqn)
        groups.setdefault(stored, {})[index] = p.detach()
    out = {}
    for stored, parts in groups.items():
        if parts.keys() == {()}:
            out[stored] = parts[()].clone()
            continue
        lead = tuple(max(i[d] for i in parts) + 1 for d in range(len(next(iter(parts)))))
        t = torch.empty(lead + tuple(next(iter(parts.values())).shape))
        for index, value in parts.items():
            t[index] = value
        out[stored] = t
    return out


def write_mcore(directory: str, state: dict, common: dict | None = None, backend: dict | None = None) -> str:
    dcp.save(state, checkpoint_id=directory, no_dist=True)
    with open(os.path.join(directory, "metadata.json"), "w") as f:
        json.dump(backend or BACKEND, f)
    torch.save(common if common is not None else {"iteration": 3}, os.path.join(directory, "common.pt"))
    return directory


SMALL = GPTConfig(
    vocab_size=64,
    hidden_size=32,
    num_layers=2,
    num_attention_heads=4,
    num_query_groups=2,
    kv_channels=16,
    ffn_hidden_size=64,
    seq_length=32,
)


def test_fully_reshardable_optimizer_state_maps_to_optim_keys(tmp_path):
    state = stacked_state(SMALL)
    torch.manual_seed(1)
    optim = {
        f"optimizer.state.{s}.{k}": torch.randn_like(v) for k, v in state.items() for s in ("exp_avg", "exp_avg_sq")
    }
    optim.update({f"optimizer.state.param.{k}": v.clone() for k, v in state.items()})  # fp32 main params, same dtype
    src = write_mcore(str(tmp_path / "src"), {**state, **optim})
    result = import_mcore(src, tmp_path / "ckpt", config=HEADS)
    assert [
        n
        for n in result.notices
        if "main params of the weights' own dtype" in n and n.startswith(f"left out {len(state)} ")
    ]
    with CheckpointReader(tmp_path / "ckpt") as reader:
        assert reader.manifest["has_optimizer"]
        qkv = "decoder.layers.self_attention.linear_qkv.weight"
        for layer in range(SMALL.num_layers):
            fqn = f"decoder.layers.{layer}.self_attention.linear_qkv.weight"
            assert torch.equal(reader.read(f"optim.{fqn}.exp_avg"), optim[f"optimizer.state.exp_avg.{qkv}"][layer])
            assert torch.equal(reader.read(f"model.{fqn}"), state[qkv][layer])
        assert not [k for k in reader.keys() if k.endswith(".main_param")]
        assert len([k for k in reader.keys() if k.endswith(".exp_avg_sq")]) == len(
            [k for k in reader.keys() if k.startswith("model.")]
        )


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cli.main", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
    )


def _refused(tmp_path, src: str, *extra: str) -> str:
    dst = tmp_path / "out" / "ckpt"
    (tmp_path / "out").mkdir()
    proc = _cli("import-mcore", src, str(dst), *extra)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert os.listdir(tmp_path / "out") == []  # nothing written, no partial directory left
    return lines[0]


def test_refuses_dp_reshardable_optimizer(tmp_path):
    state = stacked_state(SMALL)
    key = "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.float32, torch.float32).bucket_idx_0.exp_avg"
    src = write_mcore(str(tmp_path / "src"), {**state, key: torch.zeros(1000)})
    line = _refused(tmp_path, src, "--config", _config(tmp_path, HEADS))
    assert key in line and "fully_reshardable" in line


def _config(tmp_path, value: dict) -> str:
    path = tmp_path / "args.json"
    path.write_text(json.dumps(value))
    return str(path)


@pytest.mark.parametrize("kind", ["te_tensor", "bytesio"])
def test_refuses_extra_state_holding_fp8_metadata(tmp_path, kind):
    import io

    state = stacked_state(SMALL)
    fp8 = {"scale_fwd": torch.ones(3), "amax_history_fwd": torch.zeros(16, 3), "recipe": "DelayedScaling"}
    raw = pickle.dumps(fp8)
    key = "decoder.layers.self_attention.linear_qkv._extra_state/shard_1_2"
    value = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if kind == "te_tensor" else io.BytesIO(raw)
    empty = "decoder.layers.self_attention.linear_qkv._extra_state/shard_0_2"
    src = write_mcore(str(tmp_path / "src"), {**state, key: value, empty: [None]})
    line = _refused(tmp_path, src, "--config", _config(tmp_path, HEADS))
    assert key in line and ("FP8" in line)


def test_refuses_unknown_backend(tmp_path):
    src = write_mcore(
        str(tmp_path / "src"), stacked_state(SMALL), backend={"sharded_backend": "zarr", "sharded_backend_version": 1}
    )
    line = _refused(tmp_path, src, "--config", _config(tmp_path, HEADS))
    assert "metadata.json" in line and "sharded_backend 'zarr'" in line


CONFLICTS = [
    ({"num_attention_heads": 4, "hidden_size": 64}, "hidden_size", "embedding.word_embeddings.weight"),
    (
        {"num_attention_heads": 4, "num_query_groups": 4},
        "num_query_groups",
        "decoder.layers.self_attention.linear_qkv.weight",
    ),
    ({"kv_channels": 12}, "kv_channels=12", "decoder.layers.self_attention.linear_qkv.weight"),
    ({"num_attention_heads": 4, "ffn_hidden_size": 32}, "ffn_hidden_size", "decoder.layers.mlp.linear_fc2.weight"),
    ({"num_attention_heads": 4, "num_layers": 3}, "num_layers", "decoder.layers.self_attention.linear_qkv.weight"),
    (
        {"num_attention_heads": 4, "untie_embeddings_and_output_weights": False},
        "untie_embeddings_and_output_weights",
        "output_layer.weight",
    ),
]


def test_refuses_a_config_that_disagrees_with_the_shapes_cli(tmp_path):
    args, field, key = CONFLICTS[0]
    line = _refused(tmp_path, DENSE, "--config", _config(tmp_path, args))
    assert field in line and key in line and "disagrees" in line


@pytest.mark.parametrize("args, field, key", CONFLICTS[1:])
def test_refuses_a_config_that_disagrees_with_the_shapes(tmp_path, args, field, key):
    with pytest.raises(ConversionError) as e:
        import_mcore(DENSE, tmp_path / "ckpt", config=args)
    line = str(e.value)
    assert "\n" not in line and field in line and key in line and ("disagrees" in line or "whole heads" in line), line
    assert os.listdir(tmp_path) == []


def test_names_the_missing_field_without_a_config(tmp_path):
    line = _refused(tmp_path, DENSE)
    assert "num_attention_heads, num_query_groups or kv_channels is needed" in line and "--config" in line


def test_refuses_an_unsupported_argument(tmp_path):
    line = _refused(tmp_path, DENSE, "--config", _config(tmp_path, {**HEADS, "normalization": "LayerNorm"}))
    assert "normalization='LayerNorm'" in line


@pytest.mark.heavy
def test_cli_import_and_export_mcore(tmp_path):
    proc = _cli("import-mcore", DENSE, str(tmp_path / "ckpt"), "--world-size", "3", "--config", DENSE + ".config.json")
    assert proc.returncode == 0, proc.stderr
    assert "world size 3" in proc.stdout and "iteration 7" in proc.stdout and "_extra_state" in proc.stderr
    proc = _cli("export-mcore", str(tmp_path / "ckpt"), str(tmp_path / "back"))
    assert proc.returncode == 0, proc.stderr
    proc = _cli("inspect", str(tmp_path / "back"))
    assert proc.returncode == 0 and "megatron-core torch_dist" in proc.stdout and "step        7" in proc.stdout
    proc = _cli("verify", str(tmp_path / "back"))  # export-mcore's mfsdp.json checksums every chunk
    assert proc.returncode == 0, proc.stdout


def test_stacked_reads_never_hold_a_whole_stack(tmp_path):
    """Each stacked tensor saved as ONE chunk (plain dcp.save): the reader must read only the
    layer's bytes of it. Measured: the largest single read and the total bytes read."""
    cfg = GPTConfig(
        vocab_size=64,
        hidden_size=256,
        num_layers=8,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=64,
        ffn_hidden_size=1024,
        seq_length=32,
    )
    state = stacked_state(cfg)
    src = write_mcore(str(tmp_path / "src"), state)
    md = dcp.FileSystemReader(src).read_metadata()
    assert all(len(m.chunks) == 1 for m in md.state_dict_metadata.values() if hasattr(m, "chunks"))
    stack = max(v.numel() * 4 for v in state.values())  # the largest stack: fc1, 8 x 2048 x 256 fp32 = 16 MiB
    layer = max(v[0].numel() * 4 for k, v in state.items() if k.startswith("decoder.layers."))  # 2 MiB
    with McoreSource.open(src) as source:
        plan = plan_import(source, HEADS)
        for p in plan.pieces:
            source.read_slice(p.stored, p.index)
        assert source.largest_read <= layer, (source.largest_read, layer)
        total = sum(v.numel() * 4 for v in state.values())
        assert source.bytes_read <= total * 1.01, (source.bytes_read, total)  # every byte once (+ record headers)
    assert stack == 8 * layer


def test_a_slice_read_into_a_reused_tensor_equals_a_fresh_read(tmp_path):
    """``read_slice(..., reuse=t)`` fills ``t`` when shape and dtype fit (the importer hands each
    piece's tensor to the next), with exactly the values of a fresh read; a tensor that does not
    fit is left alone and a new one returned."""
    state = stacked_state(SMALL)
    src = write_mcore(str(tmp_path / "src"), state)
    with McoreSource.open(src) as source:
        plan = plan_import(source, HEADS)
        spare, reused = None, 0
        for p in plan.pieces:
            fresh = source.read_slice(p.stored, p.index)
            before = None if spare is None else spare.data_ptr()
            got = source.read_slice(p.stored, p.index, reuse=spare)
            reused += got.data_ptr() == before
            if before is not None and (spare.shape != fresh.shape or spare.dtype != fresh.dtype):
                assert got.data_ptr() != before
            assert torch.equal(got, fresh), p.canonical
            spare = got
        assert reused >= SMALL.num_layers  # the layers of a stack follow one another


_MEASURE = """
import json, os, sys, threading, time
from mfsdp_ckpt.mcore import import_mcore
from mfsdp_ckpt.mcore.source import McoreSource
from mfsdp_ckpt.mcore.import_ import plan_import
if sys.argv[3] == "whole":  # the counter-check: read every chunk whole, as a reader without slice reads would
    import mfsdp_ckpt.mcore.source as source_module
    source_module.locate_raw_tensor = lambda *a, **k: None
page = os.sysconf("SC_PAGE_SIZE")
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page
with McoreSource.open(sys.argv[1]) as s:
    plan_import(s, {"num_attention_heads": 8})
peak, done = [0], threading.Event()
def sample():
    while not done.is_set():
        peak[0] = max(peak[0], rss())
        time.sleep(0.0005)
base = rss()
t = threading.Thread(target=sample); t.start()
r = import_mcore(sys.argv[1], sys.argv[2], config={"num_attention_heads": 8})
done.set(); t.join()
print(json.dumps({"grown": max(peak[0], rss()) - base, "largest_read": r.largest_read}))
"""


def _measure(src: str, dst: str, mode: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", _MEASURE, src, dst, mode],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.heavy
def test_peak_memory_of_import_is_one_layer_not_the_stack(tmp_path):
    """Resident memory of an import process, sampled every 0.5 ms during the import, over what
    it was just before, on stacks of 256 MiB saved as one chunk each (16 layers of 16 MiB):
    below a quarter of one stack. The same measurement with slice reads switched off (every
    chunk read whole) exceeds a whole stack: the bound is the slice reads' doing."""
    cfg = GPTConfig(
        vocab_size=64,
        hidden_size=512,
        num_layers=16,
        num_attention_heads=8,
        num_query_groups=2,
        kv_channels=64,
        ffn_hidden_size=4096,
        seq_length=32,
    )
    src = write_mcore(str(tmp_path / "src"), stacked_state(cfg))
    stack = 16 * 2 * 4096 * 512 * 4
    sliced = _measure(src, str(tmp_path / "a"), "slices")
    whole = _measure(src, str(tmp_path / "b"), "whole")
    print(
        f"stack {stack >> 20} MiB, one layer {stack // 16 >> 20} MiB; RSS growth during import: "
        f"{sliced['grown'] / 2**20:.1f} MiB with slice reads (largest read {sliced['largest_read'] >> 20} MiB), "
        f"{whole['grown'] / 2**20:.1f} MiB reading whole chunks (largest read {whole['largest_read'] >> 20} MiB)"
    )
    assert sliced["largest_read"] <= stack // 16 < whole["largest_read"]
    assert sliced["grown"] < stack // 4 < stack <= whole["grown"], (sliced, whole)


def test_a_declared_shape_larger_than_the_files_is_refused_before_expanding(tmp_path):
    """A .metadata claiming 2**40 layers (chunks that do not cover it) is refused naming the key,
    before any per-layer list is built."""
    import pickle as pk

    from mfsdp_ckpt.errors import CheckpointError

    src = write_mcore(str(tmp_path / "src"), stacked_state(SMALL))
    path = os.path.join(src, ".metadata")
    with open(path, "rb") as f:
        md = pk.load(f)  # our own file, written just above
    key = "decoder.layers.self_attention.linear_qkv.weight"
    md.state_dict_metadata[key].size = torch.Size([2**40, *md.state_dict_metadata[key].size[1:]])
    with open(path, "wb") as f:
        pk.dump(md, f)
    with pytest.raises(CheckpointError) as e:
        import_mcore(src, tmp_path / "ckpt", config=HEADS)
    assert key in str(e.value) and "\n" not in str(e.value)


def test_reshard_of_an_mcore_checkpoint_points_to_import_mcore(tmp_path):
    from mfsdp_ckpt.errors import CheckpointError
    from mfsdp_ckpt.sharded.reshard import reshard

    with pytest.raises(CheckpointError, match="import-mcore"):
        reshard(DENSE, tmp_path / "out", world_size=3)
    assert not os.path.exists(tmp_path / "out")


def test_a_common_pt_that_is_not_plain_data_is_left_out_with_a_notice(tmp_path):
    """Megatron-LM's trainer may keep objects of its own classes in common.pt (e.g. enums among
    its args): nothing of it is unpickled further, the weights still import, a notice says so."""
    import datetime

    src = write_mcore(
        str(tmp_path / "src"), stacked_state(SMALL), common={"iteration": 5, "when": datetime.date(2026, 1, 1)}
    )
    result = import_mcore(src, tmp_path / "ckpt", config=HEADS)
    assert result.step is None and any(
        n.startswith("common.pt not carried: not loadable as plain data") for n in result.notices
    )
    with CheckpointReader(tmp_path / "ckpt") as reader:
        assert not [k for k in reader.keys() if k.startswith("extra.")]


def test_megatron_lm_args_in_common_pt_give_the_config(tmp_path):
    """Megatron-LM's trainer keeps its argparse namespace in common.pt: the heads and the rest
    come from it (no --config), and it is carried as a plain dict in extra.args."""
    import argparse

    args = argparse.Namespace(
        num_attention_heads=4,
        num_query_groups=2,
        rotary_base=500000,
        norm_epsilon=1e-6,
        seq_length=32,
        swiglu=True,
        normalization="RMSNorm",
        untie_embeddings_and_output_weights=True,
    )
    src = write_mcore(
        str(tmp_path / "src"), stacked_state(SMALL), common={"iteration": 11, "checkpoint_version": 3.0, "args": args}
    )
    result = import_mcore(src, tmp_path / "ckpt")
    assert result.step == 11 and result.assumed == []
    assert result.model_config["rotary_base"] == 500000 and result.model_config["norm_epsilon"] == 1e-6
    with CheckpointReader(tmp_path / "ckpt") as reader:
        assert reader.read("extra.args") == vars(args) and reader.read("extra.checkpoint_version") == 3.0


def test_megatron_lm_vocab_and_length_arguments():
    """Megatron-LM keeps the tokenizer's vocab_size next to the embedding's padded_vocab_size,
    and seq_length next to max_position_embeddings: the padded size and the longer length count."""
    from mfsdp_ckpt.mcore.config import _normalised

    out = _normalised(
        {
            "vocab_size": 50257,
            "padded_vocab_size": 50304,
            "seq_length": 2048,
            "max_position_embeddings": 4096,
            "layernorm_epsilon": 1e-6,
        }
    )
    assert out["vocab_size"] == 50304 and out["seq_length"] == 4096 and out["norm_epsilon"] == 1e-6


@pytest.mark.parametrize("variant", ["shared-qknorm-bias-tied", "sigmoid-top1"])
def test_canonical_to_mcore_and_back_for_other_model_variants(tmp_path, variant):
    """What the genuine fixtures do not cover: a shared expert, q/k norms, a QKV bias, tied
    embeddings, sigmoid routing. Ours -> export-mcore -> import-mcore (config from the
    mcore_args.json the export writes) gives back every tensor bitwise and the same config."""
    from mfsdp_ckpt.format.manifest import versions
    from mfsdp_ckpt.mcore import export_mcore
    from mfsdp_ckpt.write.builder import CheckpointBuilder

    if variant == "shared-qknorm-bias-tied":
        cfg = GPTConfig(
            vocab_size=64,
            hidden_size=32,
            num_layers=2,
            num_attention_heads=4,
            num_query_groups=1,
            kv_channels=8,
            ffn_hidden_size=48,
            num_experts=4,
            moe_router_topk=2,
            moe_ffn_hidden_size=16,
            moe_shared_expert_ffn_hidden_size=24,
            qk_layernorm=True,
            add_qkv_bias=True,
            tie_embeddings=True,
            rotary_base=1e6,
            norm_epsilon=1e-6,
            seq_length=128,
        )
    else:
        cfg = GPTConfig(
            vocab_size=64,
            hidden_size=32,
            num_layers=3,
            num_attention_heads=2,
            num_query_groups=2,
            kv_channels=16,
            ffn_hidden_size=16,
            num_experts=3,
            moe_router_topk=1,
            moe_ffn_hidden_size=16,
            moe_score_func="sigmoid",
        )
    torch.manual_seed(0)
    model = GPTModel(cfg)
    with CheckpointBuilder(tmp_path / "ours", {"model_config": cfg.to_dict(), "step": 9, "versions": versions()}) as b:
        for name, p in model.named_parameters():
            b.add_tensor(f"model.{name}", p.detach() + torch.rand_like(p))
        b.commit()
    export_mcore(tmp_path / "ours", tmp_path / "mcore")
    result = import_mcore(tmp_path / "mcore", tmp_path / "back")
    assert result.model_config == cfg.to_dict() and result.step == 9 and result.assumed == []
    with CheckpointReader(tmp_path / "ours") as a, CheckpointReader(tmp_path / "back") as b:
        keys = [k for k in a.keys() if k.startswith("model.")]
        assert keys == [k for k in b.keys() if k.startswith("model.")]
        for key in keys:
            assert torch.equal(a.read(key), b.read(key)), key


def test_slices_of_single_chunk_expert_stacks_are_the_right_bytes(tmp_path):
    """(L, E, ...) expert stacks saved as one chunk: each (layer, expert) slice read from the raw
    record is that expert's weight."""
    cfg = GPTConfig(
        vocab_size=64,
        hidden_size=32,
        num_layers=3,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=8,
        ffn_hidden_size=16,
        num_experts=5,
        moe_router_topk=2,
        moe_ffn_hidden_size=8,
        seq_length=32,
    )
    src = write_mcore(str(tmp_path / "src"), stacked_state(cfg, seed=3))
    result = import_mcore(src, tmp_path / "ckpt", config={**HEADS, "moe_router_topk": 2})
    assert result.largest_read <= 64 * 32 * 4 + 4096  # the embedding table read whole: its record, headers included
    torch.manual_seed(3)
    model = GPTModel(cfg)
    with CheckpointReader(tmp_path / "ckpt") as reader:
        for name, p in model.named_parameters():
            assert torch.equal(reader.read(f"model.{name}"), p.detach()), name
