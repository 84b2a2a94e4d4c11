"""The dtype table (``mfsdp_core.dtypes``): every spelling it lists is checked against the library
that reads it: names against torch, safetensors names by a real safetensors round trip, storage
names against what ``torch.save`` pickles, wire views bit for bit."""

from __future__ import annotations

import io
import json
import pickletools
import zipfile

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save

from mfsdp_core.dtypes import (
    CAST_CHOICES,
    DTYPES,
    dtype_by_name,
    dtype_from_safetensors,
    dtype_name,
    safetensors_name,
    storage_name,
    wire_dtype,
    wire_view,
)

ROWS = {info.name: info for info in DTYPES}
BYTE_DTYPES = [info.dtype for info in DTYPES if info.dtype.itemsize == 1 and info.dtype.is_floating_point]


def _every_value(dtype: torch.dtype) -> torch.Tensor:
    """A small tensor of ``dtype``: every bit pattern for 1-byte dtypes, else mixed values."""
    if dtype.itemsize == 1 and dtype != torch.bool:
        return torch.arange(256, dtype=torch.uint8).view(dtype)
    if dtype == torch.bool:
        return torch.tensor([True, False, True])
    return (torch.arange(-6, 6, dtype=torch.float64) * 1.5).to(dtype).reshape(3, 4)


def test_the_table_lists_what_the_project_handles():
    expected = {
        "float32",
        "bfloat16",
        "float16",
        "float64",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint8",
        "bool",
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e8m0fnu",
    }
    assert expected <= set(ROWS)
    assert len(ROWS) == len(DTYPES) and len({i.dtype for i in DTYPES}) == len(DTYPES)
    assert set(CAST_CHOICES) == {"float32", "bfloat16", "float16"}


@pytest.mark.parametrize("name", list(ROWS))
def test_name_round_trips(name):
    dtype = dtype_by_name(name)
    assert dtype is getattr(torch, name) and str(dtype) == f"torch.{name}"
    assert dtype_name(dtype) == name


def test_unknown_names_and_dtypes_raise_one_line_naming_the_valid_ones():
    with pytest.raises(ValueError) as e:
        dtype_by_name("float33")
    assert "\n" not in str(e.value) and "'float33'" in str(e.value) and "bfloat16" in str(e.value)
    with pytest.raises(ValueError, match="complex64"):
        dtype_name(torch.complex64)
    assert safetensors_name(torch.complex64) is None
    assert storage_name(torch.complex64) is None and dtype_from_safetensors("C64") is None


@pytest.mark.parametrize("dtype", BYTE_DTYPES, ids=str)
def test_fp8_and_e8m0_travel_as_uint8_bit_exact(dtype):
    t = _every_value(dtype)
    wire = wire_view(t)
    assert wire_dtype(dtype) == torch.uint8 and wire.dtype == torch.uint8
    assert wire.data_ptr() == t.data_ptr()  # a view, no copy
    assert torch.equal(wire, torch.arange(256, dtype=torch.uint8))
    assert torch.equal(wire.view(dtype).view(torch.uint8), wire)


@pytest.mark.parametrize("dtype", [i.dtype for i in DTYPES if i.dtype not in BYTE_DTYPES], ids=str)
def test_other_dtypes_travel_as_themselves(dtype):
    t = _every_value(dtype)
    assert wire_dtype(dtype) == dtype and wire_view(t) is t


def _header_dtype(data: bytes, key: str) -> str:
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + n])[key]["dtype"]


@pytest.mark.parametrize("info", [i for i in DTYPES if i.safetensors], ids=lambda i: i.name)
def test_safetensors_names_round_trip_through_safetensors(info, tmp_path):
    t = _every_value(info.dtype)
    data = safetensors_save({"x": t})
    assert _header_dtype(data, "x") == info.safetensors == safetensors_name(info.dtype)
    back = safetensors_load(data)["x"]
    assert back.dtype == info.dtype and torch.equal(back.view(torch.uint8), t.view(torch.uint8))
    path = (
        tmp_path / "x.safetensors"
    )  # through safe_open too (the HF import now parses headers itself: tests/reliability/test_hostile_hf.py)
    path.write_bytes(data)
    with safe_open(str(path), framework="pt") as f:
        assert dtype_from_safetensors(f.get_slice("x").get_dtype()) == info.dtype
        assert torch.equal(f.get_tensor("x").view(torch.uint8), t.view(torch.uint8))


@pytest.mark.parametrize("info", [i for i in DTYPES if not i.safetensors], ids=lambda i: i.name)
def test_dtypes_without_a_safetensors_name_do_not_round_trip(info):
    try:
        back = safetensors_load(safetensors_save({"x": _every_value(info.dtype)}))["x"]
    except Exception:  # noqa: BLE001 - any failure: the name is rightly unlisted
        return
    pytest.fail(f"safetensors now round-trips {info.name} (as {back.dtype}): list its name in mfsdp_core/dtypes.py")


def _pickled_globals(tensor: torch.Tensor) -> set[str]:
    """The globals (``module name``) a ``torch.save`` record's ``data.pkl`` refers to."""
    buf = io.BytesIO()
    torch.save(tensor, buf)
    with zipfile.ZipFile(buf) as z:
        (pkl,) = [n for n in z.namelist() if n.endswith("/data.pkl")]
        data = z.read(pkl)
    return {str(arg) for op, arg, _ in pickletools.genops(data) if op.name in ("GLOBAL", "STACK_GLOBAL")}


@pytest.mark.parametrize("info", DTYPES, ids=lambda i: i.name)
def test_storage_names_are_what_torch_save_pickles(info):
    found = _pickled_globals(_every_value(info.dtype))
    legacy = {g.split(" ", 1)[1] for g in found if g.startswith("torch ") and g.endswith("Storage")}
    if info.storage is not None:
        assert legacy == {info.storage} and storage_name(info.dtype) == info.storage
    else:  # an untyped storage and the dtype itself
        assert legacy == set() and "torch.storage UntypedStorage" in found and f"torch {info.name}" in found
