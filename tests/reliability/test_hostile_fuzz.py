"""Hypothesis fuzz of hostile checkpoints: hostile manifests (wrong types, bounds, names, deep
nesting, sealed with a correct checksum or not, byte flips and truncations) and hostile
``.metadata`` (DCP's own admitted classes holding hostile values, entries dropped or renamed,
byte flips and truncations, with or without the manifest's checksum of it), plus hostile files
(FIFOs, symlinks out, truncated or flipped data).

Each case runs ``inspect_checkpoint``, ``verify_checkpoint``, ``CheckpointReader.read`` of every
key, ``diff_checkpoints``, ``list_checkpoints`` and ``mfsdp_ckpt.load`` (one process) and asserts:
the result or one line of the ``CheckpointError`` family, never another exception; never a hang
(a deadline per call); no file opened outside the case's directory (audited with
``sys.addaudithook``) and nothing written. And ``verify`` is a gate: when it finds nothing wrong
with a checkpoint whose data was not touched, ``load`` succeeds and every entry reads as the
original; a ``.metadata`` changed under an intact manifest is refused by every reader.

The unmarked tests run 140 cases; the ``heavy`` ones 1,700 (800 manifests, 900 ``.metadata``; well
under three minutes). With ``HOSTILE_FUZZ_REPORT=<file>`` the counts per target and per reason
``load`` refused are appended to that file as JSON (``HOSTILE_FUZZ_DEBUG=1`` adds the messages)."""

from __future__ import annotations

import copy
import json
import os
import pickle
import pickletools
import shutil
import warnings
from collections import Counter, defaultdict
from pathlib import PurePosixPath
from typing import Any, Callable

import google_crc32c
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

import mfsdp_ckpt
from mfsdp_ckpt import CheckpointError
from mfsdp_ckpt.format.safety import memo_problem
from mfsdp_ckpt.read.reader import CheckpointReader
from mfsdp_ckpt.tools.diff import diff_checkpoints
from mfsdp_ckpt.tools.inspect import inspect_checkpoint, verify_checkpoint
from mfsdp_ckpt.tools.listing import list_checkpoints
from tests.reliability.test_hostile_support import (
    AUDIT,
    Hang,
    deadline,
    read_json,
    save_small,
    trained_mlp,
    write_json,
)

FAST = {"manifest": 60, "metadata": 80}
HEAVY = {"manifest": 800, "metadata": 900}
CALL_SECONDS = 10  # per reader call: a blocking open or an endless loop fails the case
STATS: dict[str, Counter] = defaultdict(Counter)


# ---- the base checkpoint and one case directory per example -------------------------------------


class Base:
    """One clean checkpoint (``<dir>/run/step_1`` and ``latest``), its manifest and metadata, a
    model to load into, and every entry's clean value."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.run = os.path.join(root, "run")
        self.ckpt = save_small(os.path.join(self.run, "step_1"))
        self.manifest = read_json(self.ckpt)
        with open(os.path.join(self.ckpt, ".metadata"), "rb") as f:
            self.metadata_bytes = f.read()
        self.metadata = pickle.loads(self.metadata_bytes)  # our own file
        self.model, self.optim = trained_mlp()
        with CheckpointReader(self.ckpt) as reader:
            self.values = {k: reader.read(k) for k in reader.keys()}
        self.count = 0

    def case(self) -> tuple[str, str]:
        """A fresh case directory holding a copy of the run (files hard-linked: every hostile
        edit replaces a file, never writes into one); returns (case dir, its checkpoint)."""
        self.count += 1
        case = os.path.join(self.root, f"case{self.count}")
        shutil.copytree(self.run, os.path.join(case, "run"), copy_function=os.link)
        os.makedirs(os.path.join(case, "outside"))
        with open(os.path.join(case, "outside", "secret.distcp"), "wb") as f:
            f.write(open(os.path.join(self.ckpt, "__0_0.distcp"), "rb").read())
        return case, os.path.join(case, "run", "step_1")


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Base:
    return Base(str(tmp_path_factory.mktemp("fuzz")))


def _replace(path: str, data: bytes) -> None:
    """Write ``data`` as a new file at ``path`` (never into the hard-linked original)."""
    if os.path.lexists(path):
        os.remove(path)
    with open(path, "wb") as f:
        f.write(data)


# ---- running the readers -------------------------------------------------------------------------


def _run_readers(base: Base, case: str, ckpt: str, fuzz: str) -> dict[str, Any]:
    """Every reader on ``ckpt``: its result, or its CheckpointError. Fails the case on another
    exception, a hang, or a file access outside ``case`` (the clean base is readable: diff)."""

    def read_all() -> dict[str, Any]:
        with CheckpointReader(ckpt) as reader:
            return {k: reader.read(k) for k in reader.keys()}

    def load() -> dict[str, Any]:  # a stock checkpoint too: the manifest is read whenever one is there
        return mfsdp_ckpt.load(ckpt, base.model, base.optim, require_manifest=False)

    readers: dict[str, Callable[[], Any]] = {
        "inspect": lambda: inspect_checkpoint(ckpt),
        "verify": lambda: verify_checkpoint(ckpt),
        "read": read_all,
        "diff": lambda: diff_checkpoints(ckpt, base.ckpt),
        "ls": lambda: list_checkpoints(os.path.dirname(ckpt)),
        "load": load,
    }
    out: dict[str, Any] = {}
    for name, call in readers.items():
        with AUDIT.watching(case, base.ckpt) as violations, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                with deadline(CALL_SECONDS):
                    out[name] = call()
                STATS[f"{fuzz}/{name}"]["ok"] += 1
            except CheckpointError as e:
                assert "\n" not in str(e), (name, str(e))
                out[name] = e
                STATS[f"{fuzz}/{name}"]["refused (CheckpointError)"] += 1
                if name == "load":
                    STATS[f"{fuzz}/why load refused"][_reason(str(e))] += 1
                    if os.environ.get("HOSTILE_FUZZ_DEBUG"):
                        STATS[f"{fuzz}/messages"][str(e).split(": ", 1)[-1][:90]] += 1
            except Hang:
                STATS[f"{fuzz}/{name}"]["HANG"] += 1
                raise
            except Exception:
                STATS[f"{fuzz}/{name}"]["OTHER EXCEPTION"] += 1
                raise
        if violations:
            STATS[f"{fuzz}/{name}"]["OUT-OF-PATH ACCESS"] += 1
        assert not violations, (name, violations)
    STATS[fuzz]["cases"] += 1
    return out


_REASONS = [  # (what the message says, the check that refused) for the counts
    ("manifest_crc32c", "manifest checksum"),
    ("metadata_crc32c", "metadata checksum"),
    ("field '", "manifest schema"),
    ("unreadable manifest", "manifest not JSON"),
    ("not an mfsdp-ckpt manifest", "manifest not ours"),
    ("unreadable metadata", "unpickler: garbled"),
    ("refusing to load", "unpickler: class not admitted"),
    ("outside the checkpoint", "path outside"),
    ("is absolute", "path outside"),
    ("leads out of", "path outside"),
    ("not a regular file", "not a regular file"),
    ("cannot read DCP metadata", "metadata unreadable"),
    ("no committed manifest", "no manifest"),
    ("not a checkpoint", "no .metadata"),
    ("no .metadata", "no .metadata"),
    ("missing from the checkpoint", "state mismatch"),
    ("not in the model", "state mismatch"),
    ("shape mismatch", "state mismatch"),
    ("chunks do not cover", "coverage"),
    ("truncated", "bytes missing"),
    ("checksum mismatch", "chunk checksum"),
    ("do not fit in its", "sizes vs bytes"),
    ("the manifest places it", "manifest place"),
    (".metadata: ", "metadata values"),
    ("not listed in the manifest", "chunk not in manifest"),
]


def _reason(message: str) -> str:
    return next((why for needle, why in _REASONS if needle in message), "other")


def _gate(base: Base, out: dict[str, Any]) -> None:
    """What verify passes, load reads, and it reads the original values."""
    if isinstance(out["verify"], list) and not out["verify"]:
        assert not isinstance(out["load"], CheckpointError), out["load"]
        assert not isinstance(out["read"], CheckpointError), out["read"]
        for key, value in base.values.items():
            got = out["read"][key]
            assert (
                (torch.equal(got, value) and got.dtype == value.dtype)
                if isinstance(value, torch.Tensor)
                else got == value
            ), key
        STATS["gate"]["verify passed: load and every read matched"] += 1


# ---- hostile values --------------------------------------------------------------------------------

OUTSIDE = "@OUTSIDE@"  # replaced by the absolute path of a file outside the case's checkpoint
TEXT = [
    "../outside/secret.distcp",
    "../../outside/secret.distcp",
    "/etc/passwd",
    OUTSIDE,
    "fifo",
    "__0_0.distcp",
    "__1_0.distcp",
    ".metadata",
    "mfsdp.json",
    "",
    "a\nb",
    "\x00",
    "x" * 300,
    "no_shard",
    "block(0)",
    "block(32)",
    "float32",
    "dp",
    "model.fc1.weight@0,0",
    "mfsdp-ckpt",
    "sub/dir/__0_0.distcp",
    ".",
]
INTS = [
    -(2**70),
    -(2**63),
    -1,
    0,
    1,
    2,
    3,
    13,
    64,
    2**31,
    2**32 - 1,
    2**32,
    2**38,
    2**53 + 1,
    2**62,
    2**63,
    2**64,
    10**30,
]
FIELDS = [
    "file",
    "offset",
    "length",
    "crc32c",
    "plan",
    "buffers",
    "groups",
    "world_size",
    "shapes",
    "params",
    "strategy",
    "policy",
    "group_size",
    "group_sizes",
    "dtype",
    "step",
    "chunks",
    "format",
    "format_version",
    "save_id",
    "manifest_crc32c",
    "metadata_crc32c",
    "model_config",
    "writer",
    "companions",
    "grad_divisor",
    "unit",
]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.sampled_from(INTS),
    st.floats(),
    st.text(max_size=8),
    st.sampled_from(TEXT),
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=6,
)


def _nested(depth: int) -> Any:
    value: Any = 0
    for _ in range(depth):
        value = [value]
    return value


def _outsider(value: Any, outside: str) -> Any:
    if value == OUTSIDE:
        return outside
    if isinstance(value, list):
        return [_outsider(v, outside) for v in value]
    if isinstance(value, dict):
        return {k: _outsider(v, outside) for k, v in value.items()}
    return value


# ---- hostile manifests ------------------------------------------------------------------------------


def _paths(value: Any, at: tuple = ()) -> list[tuple]:
    """Every path to a value inside a JSON document."""
    out = []
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        out.append(at + (k,))
        out += _paths(v, at + (k,))
    return out


def _container(doc: Any, path: tuple) -> tuple[Any, Any] | None:
    """(the container holding ``path``'s value, its key there); None if the path is gone."""
    node = doc
    for k in path[:-1]:
        if isinstance(node, dict) and k in node or isinstance(node, list) and isinstance(k, int) and k < len(node):
            node = node[k]
        else:
            return None
    k = path[-1] if path else None
    if (isinstance(node, dict) and isinstance(k, str)) or (
        isinstance(node, list) and isinstance(k, int) and k < len(node)
    ):
        return node, k
    return None


manifest_ops = st.lists(
    st.tuples(
        st.sampled_from(["set", "set", "set", "delete", "add", "deep"]),
        st.integers(0, 10**6),
        json_values,
        st.sampled_from(FIELDS),
        st.sampled_from([33, 40, 200, 100000]),
    ),
    min_size=1,
    max_size=3,
)
raw_ops = st.tuples(st.sampled_from([None] * 6 + ["flip", "truncate"]), st.integers(0, 10**9), st.integers(0, 7)).map(
    lambda t: None if t[0] is None else t if t[0] == "flip" else t[:2]
)  # a quarter of the cases: bytes damaged too


def _raw(data: bytes, op: Any) -> bytes:
    if op is None or not data:
        return data
    if op[0] == "flip":
        pos = op[1] % len(data)
        return data[:pos] + bytes([data[pos] ^ (1 << op[2])]) + data[pos + 1 :]
    return data[: op[1] % len(data)]


def _hostile_manifest(base: Base, ckpt: str, outside: str, ops: list, seal: str, raw: Any) -> None:
    doc: Any = copy.deepcopy(base.manifest)
    paths = _paths(doc)
    deep_text = None
    for kind, pick, value, field, depth in ops:
        path = paths[pick % len(paths)]
        where = _container(doc, path)
        if kind == "add":  # a new field in the object at ``path`` (or at the top)
            target = (
                None if where is None else where[0].get(where[1]) if isinstance(where[0], dict) else where[0][where[1]]
            )
            (target if isinstance(target, dict) else doc)[field] = _outsider(value, outside)
            continue
        if where is None:
            continue
        node, key = where
        if kind == "delete":
            if not isinstance(node, dict) or key in node:
                del node[key]
        elif kind == "deep" and depth > 500:
            node[key] = "@DEEP@"
            deep_text = "[" * depth + "0" + "]" * depth
        else:
            node[key] = _nested(depth) if kind == "deep" else _outsider(value, outside)
    write_json(ckpt, doc, seal)
    path = os.path.join(ckpt, "mfsdp.json")
    data = open(path, "rb").read()
    if deep_text is not None:
        data = data.replace(b'"@DEEP@"', deep_text.encode())
    _replace(path, _raw(data, raw))


def _manifest_case(base: Base, ops: list, seal: str, raw: Any) -> None:
    case, ckpt = base.case()
    _hostile_manifest(base, ckpt, os.path.join(case, "outside", "secret.distcp"), ops, seal, raw)
    out = _run_readers(base, case, ckpt, "manifest")
    _gate(base, out)  # the data was not touched: whatever verify passes reads as the original
    shutil.rmtree(case)


@pytest.mark.timeout(600, method="thread")
@settings(max_examples=FAST["manifest"], deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(ops=manifest_ops, seal=st.sampled_from(["reseal", "reseal", "stale", "unprotected"]), raw=raw_ops)
def test_hostile_manifest_fuzz(base, ops, seal, raw):
    _manifest_case(base, ops, seal, raw)


@pytest.mark.heavy
@pytest.mark.timeout(900, method="thread")
@settings(max_examples=HEAVY["manifest"], deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(ops=manifest_ops, seal=st.sampled_from(["reseal", "reseal", "stale", "unprotected"]), raw=raw_ops)
def test_hostile_manifest_fuzz_heavy(base, ops, seal, raw):
    _manifest_case(base, ops, seal, raw)


# ---- hostile .metadata ------------------------------------------------------------------------------

DTYPES = [
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int8,
    torch.int64,
    torch.bool,
    torch.complex64,
    torch.float8_e4m3fn,
    torch.uint8,
]
sizes = st.lists(st.sampled_from(INTS[1:-4] + [-5, 0, 1, 7]), max_size=3)
metadata_values = st.one_of(
    st.sampled_from(INTS),
    st.none(),
    st.booleans(),
    st.floats(),
    st.text(max_size=6),
    st.sampled_from(TEXT),
    sizes.map(lambda s: torch.Size(s)),
    st.lists(st.sampled_from(INTS), max_size=3).map(tuple),
    st.lists(st.sampled_from(INTS), max_size=3),
    st.sampled_from(DTYPES),
    st.just({}),
    st.just([]),
    st.sampled_from(["../outside/secret.distcp", OUTSIDE]).map(PurePosixPath),
    st.just(ChunkStorageMetadata(torch.Size([0]), torch.Size([2**38]))),
    st.just(_StorageInfo("fifo", 0, 10)),
    st.just(BytesStorageMetadata()),
    st.just(TensorProperties(dtype=torch.float64)),
    st.just(MetadataIndex("x")),
)


def _slots(md: Any) -> list[tuple]:
    """Paths to every attribute of every object in the metadata (navigated by :func:`_object`);
    earlier edits may have broken it, so nothing is assumed."""
    out = [("md", f) for f in ("state_dict_metadata", "storage_data", "storage_meta", "version")]
    out += [("storage_meta", f) for f in ("save_id", "checkpoint_id")]
    state = getattr(md, "state_dict_metadata", None)
    for i, entry in enumerate(state.values() if isinstance(state, dict) else ()):
        if isinstance(entry, TensorStorageMetadata):
            out += [("sdm", i, f) for f in ("properties", "size", "chunks")] + [("props", i, "dtype")]
            chunks = getattr(entry, "chunks", None)
            out += [
                ("chunk", i, j, f)
                for j in range(len(chunks) if isinstance(chunks, list) else 0)
                for f in ("offsets", "sizes")
            ]
    storage = getattr(md, "storage_data", None)
    for i in range(len(storage) if isinstance(storage, dict) else 0):
        out += [("index", i, f) for f in ("fqn", "offset")] + [
            ("info", i, f) for f in ("relative_path", "offset", "length")
        ]
    return out


def _object(md: Any, slot: tuple) -> tuple[Any, str] | None:
    """(object, attribute) for a slot of :func:`_slots`, or None if it is gone."""
    try:
        kind = slot[0]
        if kind == "md":
            return md, slot[1]
        if kind == "storage_meta":
            return (md.storage_meta, slot[1]) if md.storage_meta is not None else None
        if kind in ("sdm", "props", "chunk"):
            entry = list(md.state_dict_metadata.values())[slot[1]]
            if kind == "sdm":
                return entry, slot[2]
            if kind == "props":
                return entry.properties, slot[2]
            return entry.chunks[slot[2]], slot[3]
        index, info = list(md.storage_data.items())[slot[1]]
        return (index, slot[2]) if kind == "index" else (info, slot[2])
    except (AttributeError, IndexError, TypeError, KeyError):
        return None


metadata_ops = st.lists(
    st.one_of(
        st.tuples(st.just("set"), st.integers(0, 10**6), metadata_values),
        st.tuples(st.just("delete"), st.integers(0, 10**6), st.none()),
        st.tuples(
            st.sampled_from(["drop_entry", "drop_stored", "rename_entry", "rename_stored"]),
            st.integers(0, 10**6),
            st.sampled_from(["model.fc1.weight", "model.fc1.weighX", "extra.step", "a\nb", "", "x" * 300]),
        ),
        st.tuples(st.just("shift"), st.integers(0, 10**6), st.integers(-200, 200)),
        st.tuples(st.just("huge"), st.integers(0, 10**6), st.sampled_from([2**38, 2**62, 2**63])),
    ),
    min_size=1,
    max_size=3,
)
file_ops = st.one_of(
    *[st.none()] * 4,
    st.tuples(st.just("data_flip"), st.integers(0, 10**9), st.integers(0, 7)),
    st.tuples(st.just("data_truncate"), st.integers(0, 10**9)),
    st.sampled_from(
        [
            ("data_fifo",),
            ("data_symlink_out",),
            ("data_dir",),
            ("metadata_fifo",),
            ("manifest_symlink_out",),
            ("latest_fifo",),
            ("metadata_symlink_out",),
        ]
    ),
)


def _apply_metadata_op(md: Any, op: tuple, outside: str) -> None:
    kind, pick, arg = op
    if kind in ("set", "delete"):
        slots = _slots(md)
        where = _object(md, slots[pick % len(slots)])
        if where is None:
            return
        obj, attr = where
        if obj is None or not hasattr(obj, "__dict__"):
            return
        if kind == "delete":
            obj.__dict__.pop(attr, None)
        else:
            object.__setattr__(
                obj,
                attr,
                PurePosixPath(outside)
                if arg == PurePosixPath(OUTSIDE)
                else outside
                if arg == OUTSIDE
                else copy.deepcopy(arg),
            )
        return
    if not isinstance(getattr(md, "state_dict_metadata", None), dict) or not isinstance(
        getattr(md, "storage_data", None), dict
    ):
        return
    if kind in ("drop_entry", "rename_entry") and md.state_dict_metadata:
        items = list(md.state_dict_metadata.items())
        i = pick % len(items)
        if kind == "drop_entry":
            del items[i]
        else:
            items[i] = (arg, items[i][1])
        md.state_dict_metadata = dict(items)
    elif kind in ("drop_stored", "rename_stored") and md.storage_data:
        items = list(md.storage_data.items())
        i = pick % len(items)
        if kind == "drop_stored":
            del items[i]
        else:
            index = items[i][0]
            items[i] = (MetadataIndex(arg, index.offset), items[i][1])
        md.storage_data = dict(items)
    elif kind == "shift" and md.storage_data:
        info = list(md.storage_data.values())[pick % len(md.storage_data)]
        if isinstance(getattr(info, "offset", None), int):
            info.offset = max(info.offset + arg, 0) if pick % 2 else info.offset + arg
    elif kind == "huge":
        tensors = [(k, v) for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)]
        if tensors:
            key, entry = tensors[pick % len(tensors)]
            entry.size = torch.Size([arg]) if arg < 2**63 else (arg,)
            entry.chunks = [ChunkStorageMetadata(torch.Size([0]), entry.size if arg < 2**63 else (arg,))]
            for index in list(md.storage_data):
                if index.fqn == key:
                    info = md.storage_data.pop(index)
                    md.storage_data[MetadataIndex(key, torch.Size([0]))] = info


def _apply_file_op(case: str, ckpt: str, op: Any) -> None:
    if op is None:
        return
    data_file = os.path.join(ckpt, "__0_0.distcp")
    outside = os.path.join(case, "outside", "secret.distcp")
    kind = op[0]
    if kind in ("data_flip", "data_truncate"):
        _replace(
            data_file,
            _raw(open(data_file, "rb").read(), ("flip",) + op[1:] if kind == "data_flip" else ("truncate", op[1])),
        )
    elif kind.endswith("_fifo"):
        name = {"data_fifo": "__0_0.distcp", "metadata_fifo": ".metadata", "latest_fifo": "../latest"}[kind]
        if os.path.lexists(os.path.join(ckpt, name)):
            os.remove(os.path.join(ckpt, name))
        os.mkfifo(os.path.join(ckpt, name))
    elif kind.endswith("_symlink_out"):
        name = {
            "data_symlink_out": "__0_0.distcp",
            "manifest_symlink_out": "mfsdp.json",
            "metadata_symlink_out": ".metadata",
        }[kind]
        if not os.path.exists(os.path.join(ckpt, name)):
            return
        target = outside if name == "__0_0.distcp" else os.path.join(case, "outside", name)
        if name != "__0_0.distcp":
            shutil.copyfile(os.path.join(ckpt, name), target)
        os.remove(os.path.join(ckpt, name))
        os.symlink(target, os.path.join(ckpt, name))
    elif kind == "data_dir":
        os.remove(data_file)
        os.mkdir(data_file)


def _metadata_case(base: Base, ops: list, seal: str, raw: Any, file_op: Any) -> None:
    case, ckpt = base.case()
    outside = os.path.join(case, "outside", "secret.distcp")
    md = pickle.loads(base.metadata_bytes)  # a fresh copy (our own bytes), much faster than deepcopy
    for op in ops:
        try:
            _apply_metadata_op(md, op, outside)
        except (TypeError, AttributeError, KeyError):  # an index an earlier edit broke: this edit cannot be made
            pass
    try:
        data = pickle.dumps(md)
    except Exception:  # noqa: BLE001 - a value pickle itself refuses (or DCP's __getstate__ trips on)
        data = base.metadata_bytes
    data = _raw(data, raw)
    _replace(os.path.join(ckpt, ".metadata"), data)
    if seal == "stock":
        os.remove(os.path.join(ckpt, "mfsdp.json"))
    elif seal != "stale":
        manifest = read_json(ckpt)
        if seal == "reseal":
            manifest["metadata_crc32c"] = google_crc32c.value(data)
        os.remove(os.path.join(ckpt, "mfsdp.json"))
        write_json(ckpt, manifest, seal)
    _apply_file_op(case, ckpt, file_op)
    out = _run_readers(base, case, ckpt, "metadata")
    if seal == "stale" and data != base.metadata_bytes:  # changed under an intact manifest: refused by all
        for name in ("inspect", "verify", "read", "diff", "load"):
            assert isinstance(out[name], CheckpointError), (name, out[name])
        STATS["gate"]["stale .metadata refused by every reader"] += 1
    if data == base.metadata_bytes and seal != "stock" and file_op is None:
        _gate(base, out)
    shutil.rmtree(case)


@pytest.mark.timeout(600, method="thread")
@settings(max_examples=FAST["metadata"], deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(
    ops=metadata_ops,
    seal=st.sampled_from(["reseal", "reseal", "stale", "stock", "unprotected"]),
    raw=raw_ops,
    file_op=file_ops,
)
def test_hostile_metadata_fuzz(base, ops, seal, raw, file_op):
    _metadata_case(base, ops, seal, raw, file_op)


@pytest.mark.heavy
@pytest.mark.timeout(900, method="thread")
@settings(max_examples=HEAVY["metadata"], deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(
    ops=metadata_ops,
    seal=st.sampled_from(["reseal", "reseal", "stale", "stock", "unprotected"]),
    raw=raw_ops,
    file_op=file_ops,
)
def test_hostile_metadata_fuzz_heavy(base, ops, seal, raw, file_op):
    _metadata_case(base, ops, seal, raw, file_op)


# ---- a case the fuzz found ---------------------------------------------------------------------------


def _builds_to_long_binput(data: bytes) -> list[tuple[int, int]]:
    """(memo index, byte) of every one-bit flip of a ``BUILD`` opcode (``b``, bit 4 -> ``r``:
    ``LONG_BINPUT``, whose index is the next four bytes) that stores past the end of ``data``,
    smallest index first."""
    flips = [
        (int.from_bytes(data[pos + 1 : pos + 5], "little"), pos)
        for op, _, pos in pickletools.genops(data)
        if op.name == "BUILD" and pos + 5 <= len(data)
    ]
    return sorted((index, pos) for index, pos in flips if index >= len(data))


def test_a_flipped_bit_storing_at_a_huge_memo_index_is_refused_at_once(base):
    """Issue 66: with seed 154443929500631921493285507984276680308 the fuzz's 10-s deadline fired
    inside ``inspect`` on a fresh clone. A ``raw`` flip turns a ``BUILD`` of ``.metadata`` into a
    ``LONG_BINPUT`` whose index is the next four bytes, often near 2**29, and CPython's unpickler
    grew its memo array to twice the index and cleared it slot by slot (~10 GiB, tens of seconds)
    before refusing anything. Which flip does that depends on the base's bytes (its save_id and
    path differ per run), so the seed alone did not reproduce it. Every such flip of this run's
    base is refused by the scan, naming its index; the one with the smallest index (so that a
    regression fails on the message, not by exhausting memory) is written, resealed so that
    every reader reaches the unpickler, and the readers run as the fuzz runs them (deadline,
    file audit): each refuses it with one line naming the index and the bound."""
    data = pickle.dumps(pickle.loads(base.metadata_bytes))  # what _metadata_case writes when no edit applies
    flips = _builds_to_long_binput(data)
    assert flips and flips[-1][0] >= 2**24, flips  # the four bytes after a BUILD make large indices
    for index, pos in flips:
        problem = memo_problem(_raw(data, ("flip", pos, 4)))
        assert problem == f"memo index {index} at byte {pos}: past the end of a {len(data)}-byte pickle", problem
    index, pos = flips[0]
    case, ckpt = base.case()
    flipped = _raw(data, ("flip", pos, 4))
    assert flipped[pos : pos + 1] == b"r"
    _replace(os.path.join(ckpt, ".metadata"), flipped)
    manifest = read_json(ckpt)
    manifest["metadata_crc32c"] = google_crc32c.value(flipped)
    write_json(ckpt, manifest, "reseal")
    out = _run_readers(base, case, ckpt, "metadata")
    for name in ("inspect", "verify", "read", "diff", "load"):
        assert isinstance(out[name], CheckpointError), (name, out[name])
        message = str(out[name])
        assert (
            f"unreadable metadata (memo index {index} at byte {pos}: past the end of a {len(flipped)}-byte pickle)"
            in message
        ), (name, message)
    shutil.rmtree(case)


def test_hostile_fuzz_counts(base):
    """Runs last in this module: the counts of what ran (appended to $HOSTILE_FUZZ_REPORT)."""
    report = os.environ.get("HOSTILE_FUZZ_REPORT")
    if report:
        with open(report, "a") as f:
            f.write(json.dumps({k: dict(v) for k, v in sorted(STATS.items())}) + "\n")
    bad = {k: v for k, v in STATS.items() if v.get("HANG") or v.get("OTHER EXCEPTION") or v.get("OUT-OF-PATH ACCESS")}
    assert not bad, bad
