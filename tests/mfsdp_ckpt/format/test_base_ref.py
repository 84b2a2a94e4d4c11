"""The ``base`` record of a checkpoint that references its frozen weights (and the ``role`` of a
base): the schema bounds every field before a reader follows it, the name never leaves the run
directory, and the reference refuses a base that is not the one it pins."""

from __future__ import annotations

import pytest

from mfsdp_ckpt.errors import CorruptCheckpointError
from mfsdp_ckpt.format.base_ref import (
    base_file,
    base_name,
    content_id,
    reference_problem,
    reference_to,
    shown_file,
    split_base_file,
)
from mfsdp_ckpt.format.manifest_schema import check_manifest

MINIMAL = {"format": "mfsdp-ckpt", "chunks": {}}
BASE_MANIFEST = {
    **MINIMAL,
    "role": "base",
    "save_id": "s1",
    "manifest_crc32c": 7,
    "index": {"keys": {"model.w": ["float32", [4], 0]}},
}
REFERENCE = reference_to("base_step_000003", BASE_MANIFEST)


def test_a_sound_reference_and_role_pass_the_schema():
    check_manifest({**MINIMAL, "base": REFERENCE}, "m")
    check_manifest({**MINIMAL, "role": "base"}, "m")


@pytest.mark.parametrize(
    "name, problem",
    [
        ("../elsewhere", ".."),
        ("a/b", "/"),
        ("/abs", "/"),
        (".hidden", "hidden"),
        ("", "empty"),
        (3, "string"),
    ],
)
def test_a_name_that_leaves_the_run_directory_is_refused(name, problem):
    with pytest.raises(CorruptCheckpointError) as e:
        check_manifest({**MINIMAL, "base": {**REFERENCE, "name": name}}, "m")
    message = str(e.value)
    assert message.startswith("m: field 'base.name'") and problem in message and "\n" not in message, message


@pytest.mark.parametrize(
    "field, value",
    [("id", None), ("save_id", 1), ("manifest_crc32c", -1), ("manifest_crc32c", 2**32), ("manifest_crc32c", "7")],
)
def test_every_field_is_typed_and_bounded(field, value):
    with pytest.raises(CorruptCheckpointError, match=f"field 'base.{field}'"):
        check_manifest({**MINIMAL, "base": {**REFERENCE, field: value}}, "m")


@pytest.mark.parametrize("missing", ["name", "id", "save_id", "manifest_crc32c"])
def test_every_field_is_required(missing):
    with pytest.raises(CorruptCheckpointError, match="base"):
        check_manifest({**MINIMAL, "base": {k: v for k, v in REFERENCE.items() if k != missing}}, "m")


def test_a_role_other_than_base_is_refused():
    with pytest.raises(CorruptCheckpointError, match="field 'role'"):
        check_manifest({**MINIMAL, "role": "adapter"}, "m")


def test_the_reference_pins_the_base_it_was_made_from():
    assert reference_problem(REFERENCE, BASE_MANIFEST) is None
    assert "role" in reference_problem(REFERENCE, {**BASE_MANIFEST, "role": None})
    assert "save_id" in reference_problem(REFERENCE, {**BASE_MANIFEST, "save_id": "s2"})
    assert "manifest_crc32c" in reference_problem(REFERENCE, {**BASE_MANIFEST, "manifest_crc32c": 8})
    changed = {**BASE_MANIFEST, "index": {"keys": {"model.w": ["float32", [5], 0]}}}
    assert "content id" in reference_problem(REFERENCE, changed)
    assert content_id(changed) != content_id(BASE_MANIFEST) == REFERENCE["id"]


def test_names_of_bases_and_of_their_files():
    assert base_name(3, "step_000003") == "base_step_000003"
    assert base_name(None, "final") == "base_final"
    name = base_file("base_step_000003", "__0_0.distcp")
    assert split_base_file(name) == ("base_step_000003", "__0_0.distcp")
    assert shown_file(name) == "base_step_000003/__0_0.distcp"
    assert split_base_file("__0_0.distcp") is None and shown_file("__0_0.distcp") == "__0_0.distcp"
