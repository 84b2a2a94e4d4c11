"""torchtitan's key layout as names (``mfsdp_ckpt/format/titan.py``, ``read/stock.py``): fast, no
torchtitan needed."""

from __future__ import annotations

import pytest

from mfsdp_ckpt.errors import CheckpointError
from mfsdp_ckpt.format.titan import (
    is_titan_layout,
    row_chunks,
    titan_param_group_entries,
    titan_to_canonical,
    to_titan_key,
)
from mfsdp_ckpt.read.stock import canonical_names, hiding, parse_key_map, stock_param_groups

TITAN = [
    "tok_embeddings.weight",
    "layers.0.attention.qkv_linear.wq.weight",
    "layers.0.attention.qkv_linear.wk.weight",
    "layers.0.attention.qkv_linear.wv.weight",
    "optimizer.state.tok_embeddings.weight.exp_avg",
    "optimizer.state.tok_embeddings.weight.step",
    "optimizer.state.layers.0.attention.qkv_linear.wqkv.weight.exp_avg",
    "optimizer.param_groups.tok_embeddings.weight.lr",
    "optimizer.param_groups.tok_embeddings.weight.betas",
    "optimizer.param_groups.layers.0.attention.qkv_linear.wqkv.weight.lr",
    "optimizer.param_groups.layers.0.attention.qkv_linear.wqkv.weight.betas",
    "lr_scheduler.last_epoch",
    "train_state.step",
    "dataloader.dp_rank_0",
    "dataloader.world_size",
]


def test_the_layout_is_told_by_its_names_and_megatron_cores_is_not():
    assert is_titan_layout(set(TITAN))
    # the optimizer's entries alone, naming a bare entry as their parameter, are enough
    assert is_titan_layout({"w", "optimizer.state.w.exp_avg"})
    # Megatron-Core: optimizer.state.<state>.<key>, no trainer entries
    assert not is_titan_layout({"decoder.fc.weight", "optimizer.state.exp_avg.decoder.fc.weight"})
    # bare names alone (a plain dcp.save, or torchtitan's model-only save) and canonical ones
    assert not is_titan_layout({"w", "b"})
    assert not is_titan_layout({"model.w", "train_state.step"})


def test_canonical_names_of_a_titan_checkpoint():
    names = canonical_names(TITAN)
    assert names.layout == "torchtitan"
    assert names.sources["model.layers.0.attention.qkv_linear.wq.weight"] == "layers.0.attention.qkv_linear.wq.weight"
    assert names.sources["optim.layers.0.attention.qkv_linear.wqkv.weight.exp_avg"] == (
        "optimizer.state.layers.0.attention.qkv_linear.wqkv.weight.exp_avg"
    )
    assert names.sources["train_state.step"] == "train_state.step"
    assert len(names.group_parts) == 4 and "optim.param_groups" in names.keys()
    values = {"lr": 0.1, "betas": (0.9, 0.95)}
    groups = stock_param_groups(names.group_parts, lambda k: values[k.rsplit(".", 1)[1]])
    assert groups == [
        {
            "lr": 0.1,
            "betas": (0.9, 0.95),
            "params": ["layers.0.attention.qkv_linear.wqkv.weight", "tok_embeddings.weight"],
        }
    ]
    # and back: one entry per parameter and hyper-parameter, the names as torchtitan's
    entries = titan_param_group_entries(groups, "src")
    assert sorted(entries) == sorted(k for k in TITAN if k.startswith("optimizer.param_groups."))
    for stored in TITAN:
        canonical = titan_to_canonical(stored)
        if canonical is not None:
            assert to_titan_key(canonical) == stored
    # without the layout's marks (stock_layout=False: a committed canonical checkpoint) nothing maps
    assert canonical_names(TITAN, stock_layout=False).layout is None


def test_canonical_keys_in_titans_layout():
    assert to_titan_key("model.norm.weight") == "norm.weight"
    assert to_titan_key("optim.norm.weight.exp_avg") == "optimizer.state.norm.weight.exp_avg"
    assert to_titan_key("optim.norm.weight.main_param") == "norm.weight"  # the fp32 weights stand in
    assert (
        to_titan_key("extra.step") == "extra.step"
        and to_titan_key("lr_scheduler.last_epoch") == "lr_scheduler.last_epoch"
    )
    assert [to_titan_key(k) for k in ("grad.w", "mx.w.rowwise_data", "extra.rng.rank0", "optim.param_groups")] == [
        None
    ] * 4
    with pytest.raises(CheckpointError, match="not a list of parameter groups"):
        titan_param_group_entries({"lr": 1}, "src")


def test_row_chunks_are_fsdp2s():
    assert row_chunks(256, 3) == [(0, 86), (86, 172), (172, 256)]
    assert row_chunks(2, 3) == [(0, 1), (1, 2), (2, 2)]
    assert row_chunks(0, 2) == [(0, 0), (0, 0)]


def test_a_key_map_filing_non_model_entries_as_weights_is_refused_naming_them():
    with pytest.raises(CheckpointError) as e:
        canonical_names(TITAN, parse_key_map(["=model."]))
    line = str(e.value)
    assert "\n" not in line and line.startswith("--key-map '=model.' would file 11 entries that are not model weights")
    assert "optimizer.* (7), dataloader.* (2), lr_scheduler.* (1), train_state.* (1)" in line
    assert line.endswith("a torchtitan checkpoint is read without a key map")
    # only the rule that files them is named; a rule filing weights alone is accepted
    with pytest.raises(CheckpointError, match=r"^--key-map 'optimizer\.=model\.' would file 7 entries"):
        canonical_names(TITAN, parse_key_map(["tok_=model.tok_", "optimizer.=model."]))
    assert "model.w" in canonical_names(["w", "b"], parse_key_map(["=model."])).sources
    # objects are never weights (a metadata mapping says which entries are objects)
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorProperties, TensorStorageMetadata

    md = {"w": TensorStorageMetadata(TensorProperties(), [1], []), "step": BytesStorageMetadata()}
    with pytest.raises(
        CheckpointError, match=r"would file 1 entry that is not a model weight as model\.\*: step \(1\), e\.g\. step$"
    ):
        canonical_names(md, parse_key_map(["=model."]))


def test_hidden_entries_leave_the_canonical_names():
    names = canonical_names(TITAN, hiding(["layers.0.attention.qkv_linear.wq.weight"]))
    assert "model.layers.0.attention.qkv_linear.wq.weight" not in names.sources
    assert "model.layers.0.attention.qkv_linear.wk.weight" in names.sources
    assert str(hiding(["a.b"])[0]) == "a.b=(hidden)"
