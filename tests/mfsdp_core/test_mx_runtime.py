"""MXFP8 weights in the runtime: block-atomic sharding keeps quantization local, the all-gather
moves MX planes instead of weights, forward computes with the rowwise planes and backward with the
columnwise ones, and a parameter that cannot be blocked is refused (real gloo processes)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mfsdp_core import (
    MixedPrecision,
    Placement,
    count_comm,
    describe_shards,
    fully_shard,
    fully_shard_optimizer,
)
from mfsdp_core.fully_shard import buffers_of
from mfsdp_core.models.gpt import GPTModel, get_preset, linear_weights, shard_units
from mfsdp_core.mx import MXFormat, dequantize, quantize
from mfsdp_core.plan import mx_placement

warnings.filterwarnings("ignore", message=".*native MXFP8 cast unavailable.*")
PLANES = ("rowwise_data", "rowwise_scale", "columnwise_data", "columnwise_scale")


# --------------------------------------------------------------------------------------------------
# locality: a 4096 x 1024 weight on 3 ranks


class Big(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4096, 1024, generator=torch.Generator().manual_seed(3)) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def _local_planes(fmt: dict) -> dict:
    model = fully_shard(Big(), placement=mx_placement(MXFormat(**fmt)))
    optim = fully_shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    model(torch.randn(2, 1024)).sum().backward()
    with count_comm() as comm:  # the step and each rank's quantization of its new blocks
        optim.step()
    ps = describe_shards(model)[0]
    layout = ps.spec.layout
    return {
        "owned": ps.owned,
        "main": ps.main.tensor.clone(),
        "planes": {
            name: (s.start, s.end, s.tensor.view(torch.uint8).clone()) for name, s in ps.companions.items()
        },  # fp8 does not pickle
        "step_ops": comm.ops(),
        "shard_size": layout.shard_size,
        "ideal": -(-4096 * 1024 // dist.get_world_size()),
    }


@pytest.mark.parametrize("fmt", [{"element": "e4m3", "rule": "floor"}, {"element": "e5m2", "rule": "rceil"}])
def test_each_rank_quantizes_its_own_blocks_exactly_as_the_whole_tensor(ranks, fmt):
    """3 ranks, block(32): each rank's planes, quantized locally after the step from the rows it
    owns, equal the slices of quantizing the whole (stepped) tensor; no collective runs in the
    step; padding is at most one 32-row block per rank."""
    out = ranks(_local_planes, 3, fmt, timeout=300)
    main = torch.cat([o["main"] for o in out]).view(4096, 1024)
    for axis in ("row", "col"):
        data, scale = quantize(main, MXFormat(**fmt), axis)
        prefix = "rowwise" if axis == "row" else "columnwise"
        for name, whole in ((f"{prefix}_data", data), (f"{prefix}_scale", scale)):
            flat = whole.reshape(-1).view(torch.uint8)
            for o in out:
                start, end, mine = o["planes"][name]
                assert torch.equal(mine.view(torch.uint8), flat[start:end]), (name, start)
    for o in out:
        assert o["step_ops"] == []  # no amax all-reduce, no gather: the planes are local
        assert o["owned"][0] % (32 * 1024) == 0  # whole 32-row blocks
        padding = o["shard_size"] - o["ideal"]
        assert 0 <= padding <= 32 * 1024, padding  # at most one block per rank
    print(
        f"shard {out[0]['shard_size']} elements vs {out[0]['ideal']} even: padding {out[0]['shard_size'] - out[0]['ideal']} "
        f"({(out[0]['shard_size'] - out[0]['ideal']) / (32 * 1024):.2f} block) per rank"
    )


# --------------------------------------------------------------------------------------------------
# what the all-gather moves


def _gathered_bytes(mx: bool) -> dict:
    config = get_preset("tiny")
    torch.manual_seed(0)
    model = GPTModel(config)
    marked = {id(p) for p in linear_weights(model)}
    place = (
        (lambda n, p: mx_placement() if id(p) in marked else Placement("block(32)")) if mx else Placement("block(32)")
    )
    for unit in shard_units(model):
        fully_shard(unit, placement=place, mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
    tokens = torch.randint(0, config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(dist.get_rank()))
    linear_numel = sum(p.numel() for p in linear_weights(model))
    with count_comm() as comm:
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)).backward()
    by_dtype: dict[str, int] = {}
    for r in comm.records:
        if r.op == "all_gather":
            by_dtype[str(r.dtype)] = by_dtype.get(str(r.dtype), 0) + r.bytes
    mx_buffers = [b for b in buffers_of(model) if b.mx is not None]
    return {
        "by_dtype": by_dtype,
        "linear_numel": linear_numel,
        "mx_gathered": sum(b.layout.gathered_size for b in mx_buffers),
    }


def test_the_all_gather_moves_mx_planes_instead_of_bf16_weights(ranks):
    """ZeRO-3, bf16 compute, 3 ranks, one forward and backward of `tiny`: with MXFP8 linears the
    linear weights travel as fp8 data + e8m0 scales, rowwise before forward and columnwise before
    backward (2 x (1 + 1/32) bytes per element, padding included), never as bf16."""
    bf16, mx = ranks(_gathered_bytes, 3, False, timeout=300), ranks(_gathered_bytes, 3, True, timeout=300)
    n = mx[0]["mx_gathered"]  # gathered elements of the MX buffers (their padded size)
    fp8 = mx[0]["by_dtype"].get("torch.float8_e4m3fn", 0)
    e8m0 = mx[0]["by_dtype"].get("torch.float8_e8m0fnu", 0)
    assert fp8 == 2 * n  # one byte per element, each orientation once
    assert e8m0 == 2 * n // 32  # one scale per 32 elements, each orientation once
    saved = bf16[0]["by_dtype"]["torch.bfloat16"] - mx[0]["by_dtype"]["torch.bfloat16"]
    assert saved == 2 * 2 * n  # the linears' bf16 weights, forward and backward, no longer travel
    total_bf16 = sum(bf16[0]["by_dtype"].values())
    total_mx = sum(mx[0]["by_dtype"].values())
    print(
        f"all-gather bytes per step and rank: bf16 {total_bf16:,}, MXFP8 linears {total_mx:,} "
        f"({1 - total_mx / total_bf16:.1%} less); the linears alone: {4 * n:,} -> {fp8 + e8m0:,} "
        f"({1 - (fp8 + e8m0) / (4 * n):.1%} less)"
    )


# --------------------------------------------------------------------------------------------------
# forward with the rowwise planes, backward with the columnwise ones


class One(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(64, 96, generator=torch.Generator().manual_seed(5)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads", "optim_grads_params"])
def test_forward_uses_rowwise_and_backward_columnwise_planes(strategy):
    """One process: y = x @ dequant(rowwise)^T, dx = dy @ dequant(columnwise), dW = dy^T x; the
    two orientations differ, so using the wrong one would show."""
    fmt = MXFormat()
    w = One().weight.detach().clone()
    model = fully_shard(One(), strategy=strategy, placement=mx_placement(fmt))
    for _ in range(2):  # the second pass runs after the first switched to columnwise
        x = torch.randn(5, 96, generator=torch.Generator().manual_seed(1), requires_grad=True)
        dy = torch.randn(5, 64, generator=torch.Generator().manual_seed(2))
        y = model(x)
        y.backward(dy)
        w_row = dequantize(*quantize(w, fmt, "row"), "row")
        w_col = dequantize(*quantize(w, fmt, "col"), "col")
        assert not torch.equal(w_row, w_col)
        torch.testing.assert_close(y, x.detach() @ w_row.t(), rtol=0, atol=0)
        torch.testing.assert_close(x.grad, dy @ w_col, rtol=0, atol=0)
        grad = buffers_of(model)[0].grad[: w.numel()].view_as(w)
        torch.testing.assert_close(grad, dy.t() @ x.detach() * 2 if _ else dy.t() @ x.detach(), rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------------------------------
# refusals


def test_a_parameter_that_cannot_be_blocked_is_refused_naming_it():
    class Odd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(48, 64, bias=False)  # 64 x 48: 48 is not a multiple of 32

    with pytest.raises(
        ValueError,
        match=r"fully_shard\(Odd\): parameter 'proj.weight' of shape \(64, 48\): MXFP8 needs a "
        r"2-D weight whose dims are both multiples of 32",
    ):
        fully_shard(Odd(), placement=mx_placement())
    with pytest.raises(
        ValueError,
        match=r"parameter 'weight': policy even can split its 32-row blocks, which MXFP8 keeps whole on one rank",
    ):
        fully_shard(One(), placement=mx_placement(policy="even"))
