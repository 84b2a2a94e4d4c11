"""``mfsdp_ckpt.save`` of a ``transformers`` model sharded by hand (``fully_shard`` per decoder
layer, AdamW through ``fully_shard_optimizer``, 3 steps on 2 gloo ranks) records the model, so
that ``export-hf`` needs nothing else: ``from_pretrained`` of the export holds the checkpoint's
parameters bit for bit."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import transformers
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import mfsdp_ckpt
from mfsdp_ckpt.hf import export
from mfsdp_ckpt.read.manifest import read_manifest
from mfsdp_core import fully_shard, fully_shard_optimizer
from tests.hf_models import hf_config


def _train_and_save(path: str, family: str) -> None:
    import torch.distributed as dist

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(family))
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optim = fully_shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(3):
        tokens = torch.randint(0, 96, (2, 9), generator=g)
        logits = model(input_ids=tokens[:, :-1]).logits
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)).backward()
        optim.step()
        optim.zero_grad()
    mfsdp_ckpt.save(path, model, optim)


def test_a_hand_sharded_transformers_model_saves_and_exports(ranks, tmp_path):
    for family in ("llama", "mixtral"):
        ckpt, out = tmp_path / family, tmp_path / f"{family}-hf"
        ranks(_train_and_save, 2, str(ckpt), family)
        record = read_manifest(str(ckpt))["model_source"]
        assert record["kind"] == "transformers" and record["class"] == type_name(family)
        export(ckpt, out)
        dcp_to_torch_save(str(ckpt), str(tmp_path / "flat.pt"))
        saved = torch.load(tmp_path / "flat.pt", weights_only=True)
        model = transformers.AutoModelForCausalLM.from_pretrained(out)
        names = [n for n, _ in model.named_parameters()]
        assert sorted(f"model.{n}" for n in names) == sorted(k for k in saved if k.startswith("model."))
        for name, p in model.named_parameters():
            assert torch.equal(p.detach(), saved[f"model.{name}"]), name


def type_name(family: str) -> str:
    return {"llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM"}[family]
