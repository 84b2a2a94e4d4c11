"""Flat range → boxes: at most 2·ndim − 1 boxes, covering the range exactly once, each a view."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mfsdp_ckpt.format.boxes import box_view, flat_range_to_boxes


@st.composite
def shape_and_range(draw):
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=0, max_size=4)))
    numel = math.prod(shape)
    start = draw(st.integers(0, numel))
    end = draw(st.integers(start, numel))
    return shape, start, end


@settings(max_examples=400, deadline=None)
@given(shape_and_range())
def test_boxes_cover_the_range_once_as_views(case):
    shape, start, end = case
    full = torch.arange(math.prod(shape)).reshape(shape)
    flat = full.reshape(-1)[start:end].clone()
    boxes = flat_range_to_boxes(shape, start, end)
    assert len(boxes) <= max(2 * len(shape) - 1, 1)
    covered = []
    for box in boxes:
        region = full[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))]
        view = box_view(flat, start, box)
        assert torch.equal(view, region)
        assert view.data_ptr() == flat[box.flat_start - start :].data_ptr()  # a view, no copy
        covered += region.reshape(-1).tolist()
    assert covered == list(range(start, end))


def test_two_dim_example():
    boxes = flat_range_to_boxes((4, 5), 3, 17)
    assert [(b.offsets, b.sizes) for b in boxes] == [((0, 3), (1, 2)), ((1, 0), (2, 5)), ((3, 0), (1, 2))]


def test_range_outside_tensor_is_refused():
    with pytest.raises(ValueError, match=r"outside a tensor of shape \(2, 3\)"):
        flat_range_to_boxes((2, 3), 4, 7)
