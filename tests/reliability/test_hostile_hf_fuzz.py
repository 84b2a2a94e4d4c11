"""Generated hostile Hugging Face directories through ``mfsdp_ckpt.hf.import_``.

Each case copies a small valid directory (one of the five built-in architectures, one shard or
two with an index), damages one target with a few generated edits, and imports it under the
guards of test_hostile_hf_helpers.py. Whatever the edits, the import either

- refuses with an exception of the ``CheckpointError`` family, on one line, leaving nothing at
  the destination (no checkpoint, no temporary sibling), or
- commits a checkpoint holding exactly what the files hold as an independent reader (the
  ``safetensors`` library) reads them, merged by the mapping;

and never raises anything else, never runs past its time limit or blocks on a FIFO, and never
opens, lists, creates, renames or removes a path outside its HF directory and its destination (a
valid copy of a shard lies next to the HF directory as bait for index entries that lead out).

Targets: ``config.json`` (field values of every JSON type and size, missing fields, non-object
documents, broken text), the index (file names that lead out of the directory or to a FIFO, a
directory, a missing file; malformed maps and documents; no index at all), and safetensors headers
(the length field, the JSON text, every entry's dtype / shape / offsets, names, ``__metadata__``,
the data section). The unmarked tests run a quick sample; the ``heavy`` one runs 1,200 cases.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import zlib
from collections import Counter
from typing import Any, Callable

import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from mfsdp_ckpt import hf
from mfsdp_ckpt.errors import CheckpointError
from mfsdp_ckpt.hf.files import INDEX_NAME

from .test_hostile_hf_helpers import (
    CONFIGS,
    Outcome,
    assert_correct_import,
    make_hf_dir,
    nothing_at,
    run_guarded,
)

ARCHS = sorted(CONFIGS)
LIMIT_S = 10.0  # per case; a normal case takes well under a second

# --------------------------------------------------------------------------------------------------
# values


_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-3, max_value=70),
    st.sampled_from([2**16, 2**16 + 1, 2**24 + 1, 2**31, 2**63, 2**64, -(2**63), 10**6, 10**30, 10**400]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["32", "2.0", "nan", "Infinity", "-1", "silu", "default", "linear", "llama", "", "\x00", "../x"]),
)
#: any JSON value, nested a little; NaN and infinities included (``json.dumps`` writes them)
JSON_VALUES = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8,
)


def _text_damage(data: st.DataObject, text: bytes) -> bytes:
    """The serialized document, damaged as text."""
    how = data.draw(st.sampled_from(["truncate", "append", "nest", "bytes", "not-utf8", "pad"]), label="text damage")
    if how == "truncate":
        return text[: data.draw(st.integers(0, max(0, len(text) - 1)), label="cut at")]
    if how == "append":
        return text + data.draw(st.binary(min_size=1, max_size=16), label="appended")
    if how == "nest":
        depth = data.draw(st.sampled_from([10, 1000, 100_000]), label="depth")
        return b"[" * depth + b"]" * depth
    if how == "bytes":
        return data.draw(st.binary(max_size=64), label="bytes")
    if how == "not-utf8":
        return b"\xff\xfe" + text
    return b" \n\t" + text + b"   "  # whitespace around: still the same JSON


# --------------------------------------------------------------------------------------------------
# targets: each draws edits and applies them to the copy at `src` (the case root is its parent)


CONFIG_FIELDS = [
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "moe_intermediate_size",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_theta",
    "rope_parameters",
    "rope_scaling",
    "hidden_act",
    "tie_word_embeddings",
    "attention_bias",
    "mlp_bias",
    "use_sliding_window",
    "sliding_window",
    "router_jitter_noise",
    "num_local_experts",
    "num_experts",
    "num_experts_per_tok",
    "router_aux_loss_coef",
    "decoder_sparse_step",
    "mlp_only_layers",
    "norm_topk_prob",
    "model_type",
    "architectures",
    "torch_dtype",
]
#: fields whose small plausible values mostly make a model the files almost back
PLAUSIBLE = {
    "num_hidden_layers": st.integers(0, 4),
    "num_local_experts": st.integers(0, 5),
    "num_experts": st.integers(0, 5),
    "num_experts_per_tok": st.integers(0, 4),
    "num_attention_heads": st.integers(0, 5),
    "num_key_value_heads": st.integers(0, 5),
    "head_dim": st.integers(0, 9),
    "hidden_size": st.integers(0, 17),
    "vocab_size": st.integers(0, 33),
    "intermediate_size": st.integers(0, 13),
    "moe_intermediate_size": st.integers(0, 13),
    "max_position_embeddings": st.integers(-1, 100),
    "rms_norm_eps": st.floats(-1, 2),
    "rope_theta": st.floats(-10, 1e7),
    "tie_word_embeddings": st.booleans(),
    "norm_topk_prob": st.booleans(),
    "attention_bias": st.booleans(),
    "model_type": st.sampled_from(ARCHS + ["gpt2", ""]),
}


def edit_config(data: st.DataObject, src: str) -> None:
    path = os.path.join(src, "config.json")
    with open(path) as f:
        doc: Any = json.load(f)
    for _ in range(data.draw(st.integers(1, 3), label="edits")):
        op = data.draw(
            st.sampled_from(["set", "set", "plausible", "plausible", "delete", "nested", "document"]), label="op"
        )
        if not isinstance(doc, dict):
            break
        if op == "set":
            key = data.draw(st.sampled_from(CONFIG_FIELDS) | st.text(max_size=8), label="field")
            doc[key] = data.draw(JSON_VALUES, label="value")
        elif op == "plausible":
            key = data.draw(st.sampled_from(sorted(PLAUSIBLE)), label="field")
            doc[key] = data.draw(PLAUSIBLE[key], label="value")
        elif op == "delete":
            doc.pop(data.draw(st.sampled_from(CONFIG_FIELDS), label="field"), None)
        elif op == "nested":
            doc["rope_parameters"] = {
                "rope_type": data.draw(st.sampled_from(["default", "linear", "yarn"]) | JSON_VALUES, label="rope_type"),
                "rope_theta": data.draw(st.floats(1, 1e7) | JSON_VALUES, label="rope_theta"),
            }
        else:
            doc = data.draw(JSON_VALUES, label="document")
    text = json.dumps(doc).encode()
    if data.draw(st.integers(0, 9), label="damage text?") == 0:
        text = _text_damage(data, text)
    with open(path, "wb") as f:
        f.write(text)


def _special(src: str, name: str) -> None:
    """Make the odd things some index names point at."""
    p = os.path.join(src, name)
    if name == "fifo.safetensors" and not os.path.lexists(p):
        os.mkfifo(p)
    elif name == "dir.safetensors":
        os.makedirs(p, exist_ok=True)
    elif name == "sub/x.safetensors":
        os.makedirs(os.path.dirname(p), exist_ok=True)
        shutil.copy(os.path.join(src, "model-00002-of-00002.safetensors"), p)


def index_names(bait: str) -> list[str]:
    return [
        "../bait.safetensors",
        bait,
        "/etc/passwd",
        "/dev/zero",
        "sub/x.safetensors",
        "./model-00001-of-00002.safetensors",
        ".",
        "..",
        "",
        "config.json",
        INDEX_NAME,
        "missing.safetensors",
        "fifo.safetensors",
        "dir.safetensors",
        "a" * 300 + ".safetensors",
        "x\x00y.safetensors",
        "x\ny.safetensors",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "..\\bait.safetensors",
        "~/bait.safetensors",
        "file:///etc/passwd",
        "../hf/model-00001-of-00002.safetensors",
    ]


def edit_index(data: st.DataObject, src: str) -> None:
    path = os.path.join(src, INDEX_NAME)
    bait = os.path.join(os.path.dirname(src), "bait.safetensors")
    names = st.sampled_from(index_names(bait))
    with open(path) as f:
        doc: Any = json.load(f)
    files = sorted(set(doc["weight_map"].values()))
    for _ in range(data.draw(st.integers(1, 3), label="edits")):
        op = data.draw(
            st.sampled_from(["redirect", "redirect", "one", "drop", "add", "weight_map", "document", "no-index"]),
            label="op",
        )
        wm = doc.get("weight_map") if isinstance(doc, dict) else None
        if op == "no-index":
            doc = None
            break
        if op == "document" or not isinstance(wm, dict) or not wm:
            doc = data.draw(JSON_VALUES, label="document") if op == "document" else doc
            continue
        keys = sorted(wm)
        if op == "redirect":  # every tensor of one file now in another
            old, new = data.draw(st.sampled_from(files), label="file"), data.draw(names, label="to")
            _special(src, new)
            doc["weight_map"] = {k: (new if f == old else f) for k, f in wm.items()}
        elif op == "one":
            new = data.draw(names | JSON_VALUES, label="to")
            if isinstance(new, str):
                _special(src, new)
            wm[data.draw(st.sampled_from(keys), label="key")] = new
        elif op == "drop":
            wm.pop(data.draw(st.sampled_from(keys), label="key"))
        elif op == "add":
            wm[data.draw(st.text(max_size=12), label="key")] = data.draw(names | st.sampled_from(files), label="to")
        else:
            doc["weight_map"] = data.draw(JSON_VALUES, label="weight_map")
    if doc is None:  # no index: every *.safetensors in the directory, odd ones included
        os.remove(path)
        for name in data.draw(
            st.lists(st.sampled_from(["fifo.safetensors", "dir.safetensors"]), max_size=2), label="odd"
        ):
            _special(src, name)
        return
    text = json.dumps(doc).encode()
    if data.draw(st.integers(0, 9), label="damage text?") == 0:
        text = _text_damage(data, text)
    with open(path, "wb") as f:
        f.write(text)


ST_DTYPES = [
    "F32",
    "F16",
    "BF16",
    "F64",
    "I64",
    "I32",
    "I16",
    "I8",
    "U8",
    "BOOL",
    "F8_E4M3",
    "F8_E5M2",
    "U16",
    "U32",
    "U64",
    "F8_E8M0",
    "F4",
    "C64",
    "f32",
    "",
]


def _header_text(items: list[tuple[str, Any]]) -> bytes:
    """A JSON object from (name, value) pairs, repeated names kept."""
    return ("{" + ",".join(f"{json.dumps(k)}:{json.dumps(v)}" for k, v in items) + "}").encode()


def edit_header(data: st.DataObject, src: str) -> None:
    names = sorted(n for n in os.listdir(src) if n.endswith(".safetensors"))
    path = os.path.join(src, data.draw(st.sampled_from(names), label="file"))
    with open(path, "rb") as f:
        blob = f.read()
    n = int.from_bytes(blob[:8], "little")
    items: list[tuple[str, Any]] = list(json.loads(blob[8 : 8 + n]).items())
    body = blob[8 + n :]
    length: int | None = None
    text: bytes | None = None
    tensors = [i for i, (k, _) in enumerate(items) if k != "__metadata__"]
    for _ in range(data.draw(st.integers(1, 3), label="edits")):
        op = data.draw(
            st.sampled_from(
                [
                    "dtype",
                    "shape",
                    "offsets",
                    "offsets",
                    "delete",
                    "rename",
                    "duplicate",
                    "entry",
                    "field",
                    "metadata",
                    "reorder",
                    "data",
                    "length",
                    "text",
                ]
            ),
            label="op",
        )
        i = data.draw(st.sampled_from(tensors), label="tensor")
        key, entry = items[i]
        entry = dict(entry) if isinstance(entry, dict) else entry
        if op == "dtype" and isinstance(entry, dict):
            entry["dtype"] = data.draw(st.sampled_from(ST_DTYPES) | JSON_VALUES, label="dtype")
        elif op == "shape" and isinstance(entry, dict):
            shape = list(entry["shape"]) if isinstance(entry.get("shape"), list) else []
            how = data.draw(st.sampled_from(["ints", "swap", "drop", "add", "json"]), label="how")
            if how == "ints":
                shape = data.draw(
                    st.lists(st.integers(-2, 2**40) | st.sampled_from([0, 1, 2**63, 2**64]), max_size=5), label="shape"
                )
            elif how == "swap":
                shape = shape[::-1]
            elif how == "drop":
                shape = shape[1:]
            elif how == "add":
                shape = shape + [data.draw(st.integers(0, 3), label="dim")]
            else:
                shape = data.draw(JSON_VALUES, label="shape")
            entry["shape"] = shape
        elif op == "offsets" and isinstance(entry, dict):
            offsets = entry.get("data_offsets")
            ok = isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
            b, e = offsets if ok else (0, 0)
            how = data.draw(st.sampled_from(["shift", "swap", "ints", "json", "other"]), label="how")
            if how == "shift":
                d = data.draw(st.integers(-40, 40), label="by")
                entry["data_offsets"] = [b + d, e + data.draw(st.sampled_from([d, 0, -d, d + 4]), label="end by")]
            elif how == "swap":
                entry["data_offsets"] = [e, b]
            elif how == "ints":
                entry["data_offsets"] = data.draw(
                    st.lists(st.integers(-1, 2**64), min_size=0, max_size=3), label="offsets"
                )
            elif how == "other":  # another tensor's range
                j = data.draw(st.sampled_from(tensors), label="other")
                other = items[j][1]
                if isinstance(other, dict) and "data_offsets" in other:
                    entry["data_offsets"] = other["data_offsets"]
            else:
                entry["data_offsets"] = data.draw(JSON_VALUES, label="offsets")
        elif op == "delete":
            items.pop(i)
            tensors = [t for t, (k, _) in enumerate(items) if k != "__metadata__"] or [0]
            if not items:
                items = [("__metadata__", {"format": "pt"})]
            continue
        elif op == "rename":
            key = data.draw(
                st.text(max_size=12) | st.sampled_from([items[t][0] for t in tensors] + ["a\nb", "__metadata__"]),
                label="name",
            )
        elif op == "duplicate":
            items.insert(i, (key, entry))
            tensors = [t for t, (k, _) in enumerate(items) if k != "__metadata__"]
        elif op == "entry":
            entry = data.draw(JSON_VALUES, label="entry")
        elif op == "field" and isinstance(entry, dict):
            if data.draw(st.booleans(), label="remove?"):
                entry.pop(data.draw(st.sampled_from(["dtype", "shape", "data_offsets"]), label="field"), None)
            else:
                entry[data.draw(st.text(max_size=6), label="field")] = data.draw(JSON_VALUES, label="value")
        elif op == "metadata":
            m = [t for t, (k, _) in enumerate(items) if k == "__metadata__"]
            value = data.draw(
                JSON_VALUES | st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=3), label="metadata"
            )
            if m:
                items[m[0]] = ("__metadata__", value)
            else:
                items.append(("__metadata__", value))
            continue
        elif op == "reorder":
            items = data.draw(st.permutations(items), label="order")
            tensors = [t for t, (k, _) in enumerate(items) if k != "__metadata__"]
            continue
        elif op == "data":
            how = data.draw(st.sampled_from(["cut", "grow", "flip"]), label="how")
            if how == "cut":
                body = body[: data.draw(st.integers(0, max(0, len(body) - 1)), label="keep")]
            elif how == "grow":
                body = body + bytes(data.draw(st.integers(1, 64), label="more"))
            elif body:
                at = data.draw(st.integers(0, len(body) - 1), label="at")
                body = body[:at] + bytes([body[at] ^ 0xFF]) + body[at + 1 :]
            continue
        elif op == "length":
            length = data.draw(
                st.sampled_from([0, 1, 2, 7, 8, 2**63, 2**64 - 1, 100_000_001])
                | st.integers(0, 2**64 - 1)
                | st.integers(-16, 16).map(lambda d: max(0, n + d)),
                label="length",
            )
            continue
        elif op == "text":
            text = _text_damage(data, _header_text(items))
            continue
        if i < len(items):
            items[i] = (key, entry)
    header = text if text is not None else _header_text(items)
    with open(path, "wb") as f:
        f.write((len(header) if length is None else length).to_bytes(8, "little"))
        f.write(header)
        f.write(body)


TARGETS: dict[str, Callable[[st.DataObject, str], None]] = {
    "config": edit_config,
    "index": edit_index,
    "header": edit_header,
}


# --------------------------------------------------------------------------------------------------
# running


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Valid directories per (architecture, shards), made once; cases are copies."""
    root = tmp_path_factory.mktemp("hostile_hf")
    made: dict[tuple[str, int], str] = {}

    def pristine(arch: str, shards: int) -> str:
        if (arch, shards) not in made:
            made[(arch, shards)] = str(root / f"{arch}-{shards}")
            make_hf_dir(made[(arch, shards)], arch, shards=shards)
        return made[(arch, shards)]

    pristine.root = str(root)  # type: ignore[attr-defined]
    return pristine


def judge(outcome: Outcome, src: str, dest: str) -> str:
    """Fail unless the case ended as the module docstring requires; returns 'refused' or
    'imported'."""
    assert not outcome.hung, f"hang: {outcome.error!r}"
    assert not outcome.outside, f"touched outside the given paths: {outcome.outside}"
    if outcome.error is None:
        assert_correct_import(src, dest)
        return "imported"
    if not isinstance(outcome.error, CheckpointError):
        raise AssertionError(
            f"not a CheckpointError: {type(outcome.error).__name__}: {outcome.error}"
        ) from outcome.error
    assert "\n" not in str(outcome.error), str(outcome.error)
    assert nothing_at(dest), os.listdir(os.path.dirname(dest))
    return "refused"


def fuzz(target: str, examples: int, workspace: Any, heavy: bool) -> Counter:
    """Run ``examples`` generated cases against ``target``; returns the outcome counts."""
    counts: Counter = Counter()

    @seed(zlib.crc32(f"{target}-{heavy}".encode()))
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=False,
        print_blob=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(st.data())
    def case(data: st.DataObject) -> None:
        arch = data.draw(st.sampled_from(ARCHS), label="arch")
        shards = 2 if target == "index" else data.draw(st.sampled_from([1, 2]), label="shards")
        root = tempfile.mkdtemp(dir=workspace.root, prefix=f"{target}-")
        try:
            src = os.path.join(root, "hf")
            shutil.copytree(workspace(arch, shards), src)
            shutil.copy(
                os.path.join(src, "model-00002-of-00002.safetensors" if shards == 2 else "model.safetensors"),
                os.path.join(root, "bait.safetensors"),
            )
            os.makedirs(os.path.join(root, "out"))
            dest = os.path.join(root, "out", "ckpt")
            TARGETS[target](data, src)
            outcome = run_guarded(lambda: hf.import_(src, dest), src, dest, limit=LIMIT_S)
            counts[judge(outcome, src, dest)] += 1
            counts["cases"] += 1
            counts["max_seconds_x1000"] = max(counts["max_seconds_x1000"], int(outcome.seconds * 1000))
        finally:
            shutil.rmtree(root, ignore_errors=True)

    case()
    print(
        f"\nhostile-hf fuzz {target}: {counts['cases']} cases, {counts['refused']} refused, {counts['imported']} imported, "
        f"slowest {counts['max_seconds_x1000']} ms; other exceptions 0, hangs 0, outside access 0"
    )
    return counts


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_fuzz_quick(target, workspace):
    counts = fuzz(target, 40, workspace, heavy=False)
    assert counts["cases"] >= 40


@pytest.mark.heavy
@pytest.mark.timeout(600)
def test_fuzz_heavy(workspace):
    """1,200 cases: 400 per target."""
    total = sum(fuzz(target, 400, workspace, heavy=True)["cases"] for target in sorted(TARGETS))
    assert total >= 1200
