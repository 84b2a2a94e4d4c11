"""Every ``mfsdp-ckpt`` command's ``--json`` speaks the one vocabulary of docs/cli.md: the test
reads the table there, runs each command for real on small checkpoints (an imported Hugging Face
model and what the commands make of it), and checks that each command emits exactly the keys the
table gives it, ``path`` resolved, nothing ``null``, and the types the table promises."""

from __future__ import annotations

import json
import os
import re

import pytest
from click.testing import CliRunner

pytest.importorskip("transformers")

from cli.main import main
from tests.mfsdp_ckpt.hf.util import hf_config, random_hf_model, save_hf

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: the commands `mfsdp-ckpt --help` lists that have ``--json`` (``ls[]``: the keys of ls's list entries)
COMMANDS = (
    "inspect",
    "verify",
    "diff",
    "convert",
    "reshard",
    "ls[]",
    "export-hf",
    "import-hf",
    "import-mcore",
    "export-mcore",
    "upcycle",
)


def _vocabulary() -> dict[str, set[str]]:
    """command -> the keys docs/cli.md's JSON vocabulary table gives it."""
    with open(os.path.join(ROOT, "docs", "cli.md")) as f:
        text = f.read()
    section = text.split("## JSON vocabulary", 1)[1].split("\n## ", 1)[0]
    out: dict[str, set[str]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`"):
            continue
        keys = re.findall(r"`([^`]+)`", cells[0])
        for command in (c.strip() for c in cells[2].split(",")):
            out.setdefault(command, set()).update(keys)
    return out


def _json(*args: str) -> object:
    result = CliRunner().invoke(main, [*args, "--json"])
    assert result.exit_code == 0, (args, result.output, result.exception)
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def documents(tmp_path_factory) -> dict[str, dict]:
    """command -> its ``--json`` document, each command run once, in an order where each makes
    what the next reads."""
    tmp = tmp_path_factory.mktemp("vocab")
    hf = save_hf(random_hf_model(hf_config("qwen3", tie_word_embeddings=True)), str(tmp / "hf"))
    run = tmp / "run"
    ckpt = str(run / "ckpt")
    docs = {"import-hf": _json("import-hf", hf, ckpt)}
    docs["inspect"] = _json("inspect", ckpt)
    docs["verify"] = _json("verify", ckpt)
    docs["reshard"] = _json("reshard", ckpt, str(run / "resharded"), "--world-size", "2")
    docs["diff"] = _json("diff", ckpt, str(run / "resharded"))
    docs["convert"] = _json("convert", ckpt, str(tmp / "model.safetensors"), "--to", "safetensors")
    listing = _json("ls", str(run))
    assert isinstance(listing, list) and listing
    docs["ls[]"] = listing
    docs["export-hf"] = _json("export-hf", ckpt, str(tmp / "hf_out"))
    docs["export-mcore"] = _json("export-mcore", ckpt, str(tmp / "mc"))
    docs["import-mcore"] = _json("import-mcore", str(tmp / "mc"), str(tmp / "from_mc"), "--world-size", "1")
    docs["upcycle"] = _json("upcycle", ckpt, str(tmp / "moe"), "--num-experts", "2", "--topk", "1")
    return docs


def test_the_table_names_every_command():
    assert set(_vocabulary()) == set(COMMANDS)


@pytest.mark.parametrize("command", COMMANDS)
def test_keys_are_the_documented_ones(documents, command):
    want = _vocabulary()[command]
    objects = documents[command] if command == "ls[]" else [documents[command]]
    emitted: set[str] = set()
    for obj in objects:
        assert isinstance(obj, dict)
        undocumented = set(obj) - want
        assert not undocumented, f"{command} emits keys docs/cli.md does not list for it: {sorted(undocumented)}"
        assert all(v is not None for v in obj.values()), f"{command}: null values in {obj}"
        emitted |= set(obj)
    optional = {
        "base",
        "ep_size",
        "experts",
        "model_source",
        "run",
        "step",
        "unknown",
    }  # absent where they do not apply
    missing = want - emitted - optional
    assert not missing, f"docs/cli.md lists keys {command} does not emit: {sorted(missing)}"


@pytest.mark.parametrize("command", COMMANDS)
def test_values_have_the_documented_types(documents, command):
    for obj in documents[command] if command == "ls[]" else [documents[command]]:
        for key in ("path", "a", "b"):
            if key in obj:
                assert os.path.isabs(obj[key]) and os.path.normpath(obj[key]) == obj[key], (command, obj[key])
                assert os.path.exists(obj[key]), (command, obj[key])
        for key in ("files", "tensors", "entries", "bytes", "world_size", "compared"):
            if key in obj:
                assert type(obj[key]) is int and obj[key] >= 0, (command, key, obj[key])
        if "file_names" in obj:
            assert isinstance(obj["file_names"], list) and len(obj["file_names"]) == obj["files"]
        if "seconds" in obj:
            assert type(obj["seconds"]) is float and obj["seconds"] >= 0, (command, obj["seconds"])


def test_import_hf_reports_what_it_wrote(documents):
    """``bytes`` is the tensor data written into the checkpoint, which inspect totals up."""
    totals = documents["inspect"]["totals"]
    assert documents["import-hf"]["bytes"] == sum(g["bytes"] for g in totals.values())


def _saved(path: str, step: int, trainer: dict) -> str:
    """A committed checkpoint of one tensor and one object (``extra.trainer``)."""
    import torch

    from mfsdp_ckpt.write.builder import CheckpointBuilder

    with CheckpointBuilder(path, {"step": step}) as builder:
        builder.add_tensor("model.w", torch.ones(4))
        builder.add_object("extra.trainer", trainer)
        builder.commit()
    return path


def test_keys_that_do_not_apply_are_absent_in_nested_objects_too(tmp_path):
    """An object's ``dtype`` and ``shape`` (inspect's ``tensor_list``), and the ``max_abs``,
    ``rel`` and ``histogram`` of an entry that differs as an object (diff's ``different``), are
    absent, not null, as the table says of every key."""
    a = _saved(str(tmp_path / "a"), 1, {"step": 1})
    b = _saved(str(tmp_path / "b"), 1, {"step": 2})
    listed = {t["key"]: t for t in _json("inspect", a)["tensor_list"]}
    assert set(listed["extra.trainer"]) == {"key", "group", "bytes", "chunks"}, listed["extra.trainer"]
    assert listed["model.w"]["dtype"] == "float32" and listed["model.w"]["shape"] == [4]
    result = CliRunner().invoke(main, ["diff", a, b, "--json"])
    assert result.exit_code == 1, result.output
    [entry] = json.loads(result.stdout)["different"]
    assert entry["key"] == "extra.trainer" and set(entry) == {"key", "problem", "detail"}, entry


def test_paths_are_resolved_through_latest(tmp_path):
    """``verify`` and ``diff`` of a ``latest`` pointer (or the run directory holding one) name
    the checkpoint it points at, as ``inspect`` does."""
    run = tmp_path / "run"
    ckpt = _saved(str(run / "step_000001"), 1, {})
    (run / "latest").write_text("step_000001\n")
    for given in (str(run / "latest"), str(run)):
        assert _json("verify", given)["path"] == ckpt
        assert _json("inspect", given)["path"] == ckpt
        doc = _json("diff", given, ckpt)
        assert (doc["a"], doc["b"]) == (ckpt, ckpt)
