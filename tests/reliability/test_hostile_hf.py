"""Hostile Hugging Face directories given to ``import-hf``: each is refused with one
``ConversionError`` line naming the file and the field or tensor at fault, before anything is
expanded, read or written; never a traceback of another type, never a hang, never a file touched
outside the HF directory and the destination, never anything left at the destination.

One test (or one parametrized group) per problem reproduced against the bridge: a declared layer /
expert count the files cannot hold, malformed ``config.json`` / index values, index entries that
lead outside the directory or to a FIFO / directory, integer dtypes relabelled over floating
weights, and hostile safetensors headers. Then what the checks must leave working (every dtype,
the hub cache's symlinks), the command line's one error line, and the harness's own guards. The
generated cases are in test_hostile_hf_fuzz.py.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
from typing import Any, Callable

import pytest
import torch
from safetensors.torch import save_file

from mfsdp_ckpt import hf
from mfsdp_ckpt.errors import ConversionError
from mfsdp_ckpt.hf.files import INDEX_NAME, HFDirectory
from mfsdp_core.dtypes import DTYPES

from .test_hostile_hf_helpers import (
    Outcome,
    assert_correct_import,
    make_hf_dir,
    nothing_at,
    read_raw,
    run_guarded,
    write_raw,
)

#: the module (``mfsdp_ckpt.hf.import_`` the attribute is the function of that name)
import_module = importlib.import_module("mfsdp_ckpt.hf.import_")


def _import(src: str, dest: str, **kwargs: Any) -> Outcome:
    return run_guarded(lambda: hf.import_(src, dest, **kwargs), src, dest, limit=20.0)


def _refused(outcome: Outcome, dest: str, *fragments: str) -> str:
    """The case ended in one ConversionError line holding every fragment, quickly, touching
    nothing outside its paths and leaving nothing at ``dest``; returns the message."""
    assert not outcome.hung, f"hung: {outcome.error!r}"
    assert not outcome.outside, f"touched outside the given paths: {outcome.outside}"
    assert isinstance(outcome.error, ConversionError), f"expected a ConversionError, got {outcome.error!r}"
    msg = str(outcome.error)
    assert "\n" not in msg, msg
    for fragment in fragments:
        assert fragment in msg, f"{fragment!r} not in: {msg}"
    assert nothing_at(dest)
    return msg


def _edit_json(path: str, fn: Callable[[Any], Any]) -> None:
    with open(path) as f:
        value = json.load(f)
    out = fn(value)
    with open(path, "w") as f:
        f.write(out if isinstance(out, str) else json.dumps(out))


def _set(**changes: Any) -> Callable[[dict], dict]:
    return lambda d: {**d, **changes}


def _without(key: str) -> Callable[[dict], dict]:
    return lambda d: {k: v for k, v in d.items() if k != key}


# --------------------------------------------------------------------------------------------------
# 1. declared layer / expert counts are checked against the files before anything is expanded


@pytest.mark.parametrize(
    "arch,field,value,held",
    [
        ("llama", "num_hidden_layers", 10**6, None),  # over the bound of any config
        ("llama", "num_hidden_layers", 4000, "2 layers"),  # within the model config's bound (4096)
        ("qwen3", "num_hidden_layers", 3, "2 layers"),
        ("mixtral", "num_local_experts", 4000, "3 experts"),
        ("qwen3_moe", "num_experts", 4, "3 experts"),
    ],
)
def test_declared_counts_are_bounded_by_the_files_before_expanding(arch, field, value, held, tmp_path, monkeypatch):
    src, dest = str(tmp_path / "src"), str(tmp_path / "ckpt")
    make_hf_dir(src, arch)
    _edit_json(os.path.join(src, "config.json"), _set(**{field: value}))
    real_expand = import_module.expand

    def expand_no_more_than_the_files_hold(a, c):  # the files hold 2 layers of (at most) 3 experts
        assert c.num_layers <= 2 and c.num_experts <= 3, (
            f"expand reached with {c.num_layers} layers, {c.num_experts} experts"
        )
        return real_expand(a, c)

    monkeypatch.setattr(import_module, "expand", expand_no_more_than_the_files_hold)
    msg = _refused(_import(src, dest), dest, "config.json", field, str(value))
    if held:
        assert held in msg


# --------------------------------------------------------------------------------------------------
# 2. malformed config.json and index values: one line naming the file and the field


@pytest.mark.parametrize(
    "arch,edit,fragments",
    [
        ("llama", _set(hidden_size="32"), ["'hidden_size'", "integer"]),  # a string where an int goes
        ("llama", _set(num_hidden_layers=2.0), ["'num_hidden_layers'"]),
        ("llama", _set(num_attention_heads=True), ["'num_attention_heads'"]),
        ("llama", _set(vocab_size=10**30), ["'vocab_size'"]),  # huge
        ("llama", _set(vocab_size=-5), ["'vocab_size'"]),  # negative
        ("llama", _set(head_dim=10**12), ["'head_dim'"]),
        ("llama", _set(num_hidden_layers=5000), ["num_hidden_layers", "at most 4096"]),  # over the bound
        ("llama", _set(max_position_embeddings=10**400), ["'max_position_embeddings'"]),
        ("llama", _set(rms_norm_eps=float("nan")), ["'rms_norm_eps'"]),  # NaN
        ("llama", _set(rope_theta=float("inf")), ["'rope_theta'"]),
        ("llama", _set(rope_theta="abc"), ["'rope_theta'"]),
        ("llama", _set(rope_parameters=[1, 2]), ["'rope_parameters'"]),  # nested garbage
        ("llama", _set(rope_parameters={"rope_type": "default", "rope_theta": {"x": [1]}}), ["rope_theta"]),
        ("llama", _set(rope_scaling="linear"), ["'rope_scaling'"]),
        ("llama", _set(tie_word_embeddings="false"), ["'tie_word_embeddings'"]),
        ("llama", _set(attention_bias="no"), ["'attention_bias'"]),
        ("llama", _set(intermediate_size=[48]), ["'intermediate_size'"]),
        ("llama", _without("hidden_size"), ["'hidden_size'"]),  # a missing key
        ("llama", lambda d: [d], ["not a JSON object"]),  # non-dict JSON
        ("llama", lambda d: "null", ["not a JSON object"]),
        ("llama", lambda d: '{"hidden_size": ', ["not valid JSON"]),
        ("llama", lambda d: "[" * 100_000 + "]" * 100_000, ["config.json"]),  # deeper than the JSON parser recurses
        ("llama", _set(model_type=["llama"]), ["'model_type'"]),
        ("llama", lambda d: {**_without("model_type")(d), "architectures": 5}, ["'architectures'"]),
        ("mixtral", _set(num_local_experts="3"), ["'num_local_experts'"]),
        ("mixtral", _set(router_aux_loss_coef=float("nan")), ["'router_aux_loss_coef'"]),
        ("mixtral", _set(sliding_window="big"), ["'sliding_window'"]),
        ("qwen3_moe", _set(norm_topk_prob="yes"), ["'norm_topk_prob'"]),
        ("qwen3_moe", _set(mlp_only_layers={"a": 1}), ["'mlp_only_layers'"]),
        ("qwen3_moe", _set(decoder_sparse_step=None, num_experts_per_tok=-1), ["'num_experts_per_tok'"]),
        ("mixtral", _set(num_experts_per_tok=4), ["num_experts_per_tok"]),  # more than the 3 experts
        ("llama", _set(num_key_value_heads=3), ["num_key_value_heads"]),  # 2 heads in 3 groups
        (
            "llama",
            lambda d: json.dumps(d).replace('"vocab_size": 16', '"vocab_size": ' + "9" * 2000),
            ["not valid JSON", "2000 digits"],
        ),  # past the digit bound
    ],
    ids=[
        "hidden_size-str",
        "layers-float",
        "heads-bool",
        "vocab-huge",
        "vocab-negative",
        "head_dim-huge",
        "layers-over-4096",
        "max_pos-400-digits",
        "eps-nan",
        "rope_theta-inf",
        "rope_theta-str",
        "rope_parameters-list",
        "rope_theta-nested",
        "rope_scaling-str",
        "tie-str",
        "attention_bias-str",
        "intermediate-list",
        "hidden_size-missing",
        "config-list",
        "config-null",
        "config-truncated",
        "config-deep-nesting",
        "model_type-list",
        "architectures-int",
        "mixtral-experts-str",
        "mixtral-aux-nan",
        "mixtral-window-str",
        "qwen3moe-norm_topk-str",
        "qwen3moe-mlp_only-dict",
        "qwen3moe-topk-negative",
        "mixtral-topk-over-experts",
        "kv-heads-not-dividing",
        "vocab-2000-digits",
    ],
)
def test_malformed_config_is_one_line_naming_the_field(arch, edit, fragments, tmp_path):
    src, dest = str(tmp_path / "src"), str(tmp_path / "ckpt")
    make_hf_dir(src, arch)
    _edit_json(os.path.join(src, "config.json"), edit)
    _refused(_import(src, dest), dest, "config.json", *fragments)


@pytest.mark.parametrize(
    "edit,fragments",
    [
        (lambda d: {**d, "weight_map": list(d["weight_map"])}, ["'weight_map'"]),  # wrong type
        (lambda d: {**d, "weight_map": {k: 5 for k in d["weight_map"]}}, ["'weight_map'"]),
        (lambda d: {**d, "weight_map": {**d["weight_map"], "model.norm.weight": 7}}, ["model.norm.weight"]),
        (lambda d: {**d, "weight_map": {k: {"f": [1]} for k in d["weight_map"]}}, ["'weight_map'"]),  # nested garbage
        (lambda d: {"weight_map": float("nan")}, ["'weight_map'"]),  # NaN
        (lambda d: {"metadata": {}}, ["'weight_map'"]),  # a missing key
        (lambda d: [d], ["not a JSON object"]),  # non-dict JSON
        (lambda d: '{"weight_map": {"a": ', ["not valid JSON"]),
        (lambda d: {**d, "weight_map": {k: "" for k in d["weight_map"]}}, ["file name"]),
        (lambda d: {**d, "weight_map": {k: "bad\x00name.safetensors" for k in d["weight_map"]}}, ["file name"]),
    ],
    ids=[
        "weight_map-list",
        "files-int",
        "one-file-int",
        "files-nested",
        "weight_map-nan",
        "weight_map-missing",
        "index-list",
        "index-truncated",
        "file-empty-name",
        "file-nul",
    ],
)
def test_malformed_index_is_one_line_naming_the_field(edit, fragments, tmp_path):
    src, dest = str(tmp_path / "src"), str(tmp_path / "ckpt")
    make_hf_dir(src, "llama", shards=2)
    _edit_json(os.path.join(src, INDEX_NAME), edit)
    _refused(_import(src, dest), dest, INDEX_NAME, *fragments)


# --------------------------------------------------------------------------------------------------
# 3. index entries are plain file names inside the directory, and regular files


def _point_second_shard_at(src: str, name: str) -> None:
    def edit(d: dict) -> dict:
        last = sorted(set(d["weight_map"].values()))[-1]
        return {**d, "weight_map": {k: (name if f == last else f) for k, f in d["weight_map"].items()}}

    _edit_json(os.path.join(src, INDEX_NAME), edit)


@pytest.mark.parametrize("where", ["parent", "absolute", "subdirectory"])
def test_index_naming_a_file_outside_the_directory(where, tmp_path):
    """The bait is a valid copy of the shard the index redirects: the import must neither read it
    nor succeed."""
    src, dest = str(tmp_path / "src"), str(tmp_path / "ckpt")
    make_hf_dir(src, "llama", shards=2)
    shard = os.path.join(src, "model-00002-of-00002.safetensors")
    if where == "subdirectory":
        os.makedirs(os.path.join(src, "sub"))
        shutil.copy(shard, os.path.join(src, "sub", "x.safetensors"))
        name = "sub/x.safetensors"
    else:
        shutil.copy(shard, tmp_path / "bait.safetensors")
        name = "../bait.safetensors" if where == "parent" else str(tmp_path / "bait.safetensors")
    _point_second_shard_at(src, name)
    outcome = _import(src, dest)
    assert not any(p.endswith("bait.safetensors") for _, p in outcome.outside), outcome.outside
    _refused(outcome, dest, INDEX_NAME, "plain file name", repr(name))


@pytest.mark.parametrize("kind", ["fifo", "directory"])
@pytest.mark.parametrize("indexed", [True, False])
def test_a_fifo_or_directory_as_a_shard_neither_blocks_nor_crashes(kind, indexed, tmp_path):
    src, dest = str(tmp_path / "src"), str(tmp_path / "ckpt")
    make_hf_dir(src, "llama", shards=2)
    shard = os.path.join(src, "model-00002-of-00002.safetensors")
    os.remove(shard)
    os.mkfifo(shard) if kind == "fifo" else os.mkdir(shard)
    if not indexed:
        os.remove(os.path.join(src, INDEX_NAME))
    _refused(_import(src, dest), dest, "model-00002-of-00002.safetensors", "not a regular file")


@pytest.mark.parametrize("name", ["config.json", INDEX_NAME])
def test_a_fifo_as_config_or_index_does_not_block(name, tmp_path):
    src, dest = str(tmp_path / "src"), str(tmp_path / "ckpt")
    make_hf_dir(src, "llama", shards=2)
    os.remove(os.path.join(src, name))
    os.mkfifo(os.path.join(src, name))
    _refused(_import(src, dest), dest, name, "not a regular file")


# --------------------------------------------------------------------------------------------------
# 4. an integer / bool dtype relabelled over floating-point weights


@pytest.mark.parametrize(
    "dtype,label",
    [
        (torch.float32, "I32"),
        (torch.bfloat16, "I16"),
        (torch.float16, "I16"),
        (torch.float64, "I64"),
        (torch.float8_e4m3fn, "U8"),
        (torch.float8_e4m3fn, "I8"),
        (torch.float8_e4m3fn, "BOOL"),
    ],
)
@pytest.mark.parametrize("which", ["one", "all"])
def test_integer_dtype_over_floating_weights_is_refused(dtype, label, which, tmp_path):
    src, dest = str(tmp_path / "src"), str(tmp_path / "ckpt")
    make_hf_dir(src, "llama", dtype=dtype)
    path = os.path.join(src, "model.safetensors")
    header, data = read_raw(path)
    victim = "model.layers.1.self_attn.o_proj.weight"
    for k, v in header.items():
        if k == victim or (which == "all" and k != "__metadata__"):
            v["dtype"] = label
    write_raw(path, header, data)
    _refused(_import(src, dest), dest, victim, label)


# --------------------------------------------------------------------------------------------------
# 5. hostile safetensors headers


EMB = "model.embed_tokens.weight"  # [16, 8] float32: 512 bytes, first in the data section
NORM = "model.norm.weight"  # [8] float32: 32 bytes


def _entry(h: dict, key: str, **changes: Any) -> dict:
    return {**h, key: {**h[key], **changes}}


def _dup_json(h: dict, key: str) -> str:
    """The header's JSON text with the entry ``key`` written twice (a JSON object with a
    duplicate name; ``json.dumps`` of a dict cannot produce one)."""
    text = json.dumps(h)
    entry = f'"{key}": {json.dumps(h[key])}'
    return text.replace(entry, entry + ", " + entry, 1)


@pytest.mark.parametrize(
    "edit,fragments",
    [
        # the 8-byte length: beyond the file, beyond any sane header, too small
        (lambda h, d: (h, d, 10**6), ["header length"]),
        (lambda h, d: (h, d, 2**63), ["header length"]),
        (lambda h, d: (h, d, 1), ["header"]),
        (lambda h, d: (b"\xff\xfe not json at all", d), ["header"]),
        (lambda h, d: ("[1, 2, 3]", d), ["header"]),
        (lambda h, d: (json.dumps(h)[:-5], d), ["header"]),
        # offsets: reversed, overlapping, outside the data section, leaving a gap
        (lambda h, d: (_entry(h, EMB, data_offsets=[512, 0]), d), [EMB, "offsets"]),
        (lambda h, d: (_entry(h, NORM, data_offsets=[0, 32]), d), [NORM, "overlaps"]),
        (lambda h, d: (_entry(h, NORM, data_offsets=[len(d) + 32, len(d) + 64]), d), [NORM, "data section"]),
        (lambda h, d: (h, d + b"\x00" * 64), ["data section"]),
        (lambda h, d: (_entry(h, EMB, data_offsets=[0, 2**70]), d), [EMB, "offsets"]),
        (lambda h, d: (_entry(h, EMB, data_offsets=[0]), d), [EMB, "data_offsets"]),
        # shapes whose byte size is not the offsets' range
        (lambda h, d: (_entry(h, EMB, shape=[16, 4]), d), [EMB, "bytes"]),
        (lambda h, d: (_entry(h, EMB, shape=[-16, -8]), d), [EMB, "shape"]),
        (lambda h, d: (_entry(h, EMB, shape=["16", 8]), d), [EMB, "shape"]),
        (lambda h, d: (_entry(h, EMB, shape=[2**40, 2**40, 0]), d), [EMB, "bytes"]),
        # dtypes: unknown, not a string
        (lambda h, d: (_entry(h, EMB, dtype="F99"), d), [EMB, "F99"]),
        (lambda h, d: (_entry(h, EMB, dtype=4), d), [EMB, "dtype"]),
        # names: duplicated, not printable; entries that are not objects
        (lambda h, d: (_dup_json(h, EMB), d), [EMB, "twice"]),
        (
            lambda h, d: ({**{k: v for k, v in h.items() if k != NORM}, "model.norm\nweight": h[NORM]}, d),
            ["model.norm\\nweight"],
        ),
        (lambda h, d: ({**h, EMB: [1, 2]}, d), [EMB]),
        # __metadata__ of the wrong type
        (lambda h, d: ({**h, "__metadata__": ["format", "pt"]}, d), ["__metadata__"]),
        (lambda h, d: ({**h, "__metadata__": {"format": 1}}, d), ["__metadata__"]),
    ],
    ids=[
        "length-past-file",
        "length-2^63",
        "length-1",
        "not-utf8-json",
        "json-list",
        "json-truncated",
        "offsets-reversed",
        "offsets-overlap",
        "offsets-past-data",
        "trailing-bytes",
        "offsets-2^70",
        "offsets-one-int",
        "shape-bytes-mismatch",
        "shape-negative",
        "shape-str",
        "shape-zero-huge",
        "dtype-unknown",
        "dtype-int",
        "name-duplicate",
        "name-newline",
        "entry-list",
        "metadata-list",
        "metadata-int-value",
    ],
)
def test_hostile_safetensors_header(edit, fragments, tmp_path):
    src, dest = str(tmp_path / "src"), str(tmp_path / "ckpt")
    make_hf_dir(src, "llama")
    path = os.path.join(src, "model.safetensors")
    header, data = read_raw(path)
    # lay the data out in key order from 0, so that the offsets named above are what they say
    order = sorted(
        (k for k in header if k != "__metadata__"), key=lambda k: (k != EMB, k != NORM, header[k]["data_offsets"][0])
    )
    blob, laid = b"", {"__metadata__": header["__metadata__"]}
    for k in order:
        b, e = header[k]["data_offsets"]
        laid[k] = {**header[k], "data_offsets": [len(blob), len(blob) + e - b]}
        blob += data[b:e]
    write_raw(path, laid, blob)
    assert hf.import_(src, str(tmp_path / "control")).tensors > 0  # the re-laid file itself is fine
    out = edit(laid, blob)
    write_raw(path, out[0], out[1], length=out[2] if len(out) > 2 else None)
    _refused(_import(src, dest), dest, "model.safetensors", *fragments)


def test_a_valid_directory_still_imports_under_the_guards(tmp_path):
    """The guards themselves pass a correct import (the same directory layout as above)."""
    for arch in ("llama", "qwen2", "qwen3", "mixtral", "qwen3_moe"):
        src, dest = str(tmp_path / arch), str(tmp_path / f"{arch}.ckpt")
        make_hf_dir(src, arch, shards=2)
        outcome = _import(src, dest)
        assert outcome.error is None and not outcome.hung and not outcome.outside, outcome
        assert_correct_import(src, dest, arch)


# --------------------------------------------------------------------------------------------------
# what the checks must keep working: every dtype, the Hugging Face cache's symlinks, a file that
# changes after its header was checked


@pytest.mark.parametrize("info", [i for i in DTYPES if i.safetensors], ids=lambda i: i.name)
def test_the_header_reader_reads_every_dtype_as_safetensors_writes_it(info, tmp_path):
    """The import reads tensors at the offsets its own header check found (not through
    ``safe_open``): each dtype of the table comes back bit for bit, also 0-d and empty."""
    g = torch.Generator().manual_seed(0)
    if info.dtype == torch.bool:
        full = torch.randint(0, 2, (4, 8), generator=g, dtype=torch.uint8).view(torch.bool)
    else:
        full = torch.randint(0, 256, (4, 8), generator=g, dtype=torch.uint8).view(info.dtype)
    tensors = {"full": full, "scalar": full.reshape(-1)[:1].reshape(()).clone(), "empty": full[:0]}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    with HFDirectory(tmp_path) as d:
        for name, t in tensors.items():
            assert d.tensors[name].dtype == info.dtype and d.tensors[name].shape == t.shape
            back = d.read(name)
            assert back.dtype == info.dtype and back.shape == t.shape
            assert torch.equal(back.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))


def test_a_shard_replaced_after_its_header_was_checked_is_refused(tmp_path):
    src = str(tmp_path / "src")
    make_hf_dir(src, "llama")
    with HFDirectory(src) as d:
        shutil.copy(os.path.join(src, "model.safetensors"), tmp_path / "copy")
        os.replace(tmp_path / "copy", os.path.join(src, "model.safetensors"))  # same bytes, another file
        with pytest.raises(ConversionError, match="changed since its header was read"):
            d.read("model.norm.weight")


def test_a_hugging_face_cache_snapshot_of_symlinks_imports(tmp_path):
    """The hub cache keeps files in ``blobs/`` and links them from ``snapshots/<rev>/``: links
    in the directory are the owner's and are followed; only the index's names are confined."""
    src = str(tmp_path / "snapshot")
    make_hf_dir(src, "mixtral", shards=2)
    os.makedirs(tmp_path / "blobs")
    for name in os.listdir(src):
        blob = tmp_path / "blobs" / f"blob-{name}"
        os.replace(os.path.join(src, name), blob)
        os.symlink(os.path.relpath(blob, src), os.path.join(src, name))
    hf.import_(src, str(tmp_path / "ckpt"))
    assert_correct_import(src, str(tmp_path / "ckpt"), "mixtral")


def test_the_command_line_prints_one_error_line(tmp_path):
    """``mfsdp-ckpt import-hf`` on a hostile directory: exit 1, one ``error:`` line, no traceback."""
    from click.testing import CliRunner

    from cli.main import main

    src, dest = str(tmp_path / "src"), str(tmp_path / "ckpt")
    make_hf_dir(src, "llama", shards=2)
    _point_second_shard_at(src, "../bait.safetensors")
    result = CliRunner().invoke(main, ["import-hf", src, dest])
    assert result.exit_code == 1, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "plain file name" in lines[0], result.output
    assert "Traceback" not in result.output and nothing_at(dest)


def test_the_guards_catch_what_they_guard(tmp_path):
    """The harness itself: an open outside the given paths is recorded, a reader blocked on a
    FIFO is reported as a hang (and released), and a loop is stopped by the time limit."""
    src, dest = str(tmp_path / "src"), str(tmp_path / "ckpt")
    make_hf_dir(src, "llama")
    (tmp_path / "bait").write_text("x")
    outcome = run_guarded(lambda: open(tmp_path / "bait").close(), src, dest, limit=5.0)
    assert outcome.error is None and outcome.outside == [("open", str(tmp_path / "bait"))]
    os.mkfifo(os.path.join(src, "fifo"))
    outcome = run_guarded(lambda: open(os.path.join(src, "fifo")).close(), src, dest, limit=4.0)
    assert outcome.hung and not outcome.outside

    def spin() -> None:
        while True:
            pass

    outcome = run_guarded(spin, src, dest, limit=1.0)
    assert outcome.hung and outcome.seconds < 10
