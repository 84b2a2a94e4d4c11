"""Bad input to fully_shard and the optimizer adapter: one clear ValueError naming the culprit."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mfsdp_core import fully_shard, fully_shard_optimizer


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 64)
        self.odd = nn.Linear(64, 33)


def test_unknown_strategy_names_module_and_strategy():
    with pytest.raises(ValueError, match=r"fully_shard\(Linear\).*unknown sharding strategy 'zero4'"):
        fully_shard(nn.Linear(3, 4), strategy="zero4")


@pytest.mark.parametrize("policy", ["columns", "block(0)", "block(x)", 32])
def test_unknown_policy(policy):
    with pytest.raises(ValueError, match=r"fully_shard\(Linear\).*unknown sharding policy"):
        fully_shard(nn.Linear(3, 4), policy=policy)


def test_block32_on_rows_not_multiple_of_32_names_module_and_parameter():
    net = Net()
    with pytest.raises(ValueError) as err:
        fully_shard(net, policy="block(32)")
    msg = str(err.value)
    assert "fully_shard(Net)" in msg and "'odd.weight'" in msg and "33 rows" in msg
    # nothing was sharded: the module can still be sharded with a policy that fits
    assert not hasattr(net, "_mfsdp_unit") and not hasattr(net.up.weight, "_mfsdp_owner")
    fully_shard(net, policy="row")


def test_fully_shard_twice_on_one_module():
    layer = nn.Linear(3, 4)
    fully_shard(layer)
    with pytest.raises(ValueError, match=r"fully_shard\(Linear\): fully_shard was already applied"):
        fully_shard(layer)


def test_optimizer_over_unsharded_parameter():
    sharded, plain = nn.Linear(3, 4), nn.Linear(3, 4)
    fully_shard(sharded)
    optim = torch.optim.AdamW([*sharded.parameters(), *plain.parameters()])
    with pytest.raises(ValueError, match=r"param_groups\[0\] holds a parameter of shape \(4, 3\)"):
        fully_shard_optimizer(optim)


def test_optimizer_adapted_after_its_first_step():
    layer = nn.Linear(3, 4)
    fully_shard(layer, strategy="no_shard")
    optim = torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9)
    layer(torch.randn(2, 3)).sum().backward()
    for p in layer.parameters():  # a user stepping the raw optimizer by mistake
        p.grad = torch.ones_like(p)
    optim.step()
    with pytest.raises(ValueError, match="before its first step"):
        fully_shard_optimizer(optim)
