"""What a save of a fine-tuning run writes, against what it trains: a LoRA run of a genuine
transformers Llama (PEFT's adapters on q/k/v/o, everything else frozen) saved several times, and a
full fine-tuning run of the same model saved the same way. Run under torchrun::

    .venv/bin/torchrun --standalone --nproc-per-node 2 bench/trainable_save.py

Prints, for the LoRA run, the bytes of each save's data files after the first against the
trainable state (the adapters, their optimizer state, the run's ``extra.*`` state: what a save
must write to resume), as a ratio (issue 55's target: at most 1.02x), and the median save time
against the full run's. A save's bytes are those of every file it writes (data files, ``.metadata``,
``mfsdp.json``); the first save also writes the base (the frozen weights). The same LoRA run saved
with ``frozen_once=False`` (every save writes the frozen weights again: the figure before bases)
is printed beside it.

The model is built by the trainer's own sources (``mfsdp_cli.hf_source``, ``mfsdp_cli.lora_source``) from a
model directory written here (random weights, seeded); the state is trained one step before the
first save, so the optimizer state exists.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from mfsdp_cli.hf_source import HFSource
from mfsdp_cli.lora import parse_lora
from mfsdp_cli.lora_source import LoraSource, checkpoint_name
from torch.distributed.checkpoint import FileSystemReader

import mfsdp_ckpt
from mfsdp_ckpt.tools.inspect import inspect_checkpoint
from mfsdp_core import fully_shard, fully_shard_optimizer

CONFIG = dict(
    model_type="llama",
    architectures=["LlamaForCausalLM"],
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=8,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)


def _model_dir(path: str) -> str:
    """A model directory of :data:`CONFIG` (config only: the trainer's source initialises it)."""
    import json

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(CONFIG, f)
    return path


def _build(source, seed: int = 0):
    model = source.build(seed, None)
    for unit in source.shard_units(model):
        fully_shard(unit)
    source.after_shard(model)
    return model, fully_shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))


def _step(source, model, optim, step: int) -> None:
    g = torch.Generator().manual_seed(step * 1000 + dist.get_rank())
    tokens = torch.randint(0, CONFIG["vocab_size"], (2, 65), generator=g)
    logits, _ = source.forward(model, tokens[:, :-1], tokens[:, 1:])
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)).backward()
    optim.step()
    optim.zero_grad()


def _file_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def _sidecar_bytes(path: str) -> int:
    """Bytes of a checkpoint's files other than its data files (``.metadata``, ``mfsdp.json``)."""
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if not f.endswith(".distcp"))


def _saves(source, root: str, saves: int, frozen_once: bool = True) -> tuple[list[int], list[float], dict[str, int]]:
    """Each save's bytes (every file; the first save's base included) and seconds (the slowest
    rank's), and the last save's bytes by key group (``model``, ``optim``, ``extra``) and of the
    trainable model tensors."""
    model, optim = _build(source)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    sizes, seconds = [], []
    for s in range(1, saves + 1):
        _step(source, model, optim, s)
        path = os.path.join(root, f"step_{s:06d}")
        dist.barrier()
        start = time.perf_counter()
        mfsdp_ckpt.save(path, model, optim, extra={"step": s, "data_position": s}, frozen_once=frozen_once)
        dist.barrier()
        seconds.append(time.perf_counter() - start)
        bases = [n for n in os.listdir(root) if n.startswith("base_")] if s == 1 else []
        sizes.append(_file_bytes(path) + sum(_file_bytes(os.path.join(root, n)) for n in bases))
    last = os.path.join(root, f"step_{saves:06d}")
    info = inspect_checkpoint(last)
    own = FileSystemReader(last).read_metadata()  # stock DCP: the save's own records, not its base's
    groups: dict[str, int] = {"records": len(own.storage_data), "sidecars": _sidecar_bytes(last)}
    for t in info.tensors:
        groups[t.group] = groups.get(t.group, 0) + t.bytes
    names = {checkpoint_name(n) for n in trainable}
    groups["trainable model"] = sum(t.bytes for t in info.tensors if t.group == "model" and t.key[6:] in names)
    return sizes, seconds, groups


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default="/tmp/mfsdp_bench_trainable_save")
    p.add_argument("--saves", type=int, default=4)
    p.add_argument("--lora", default="r=8,alpha=16,targets=q_proj,k_proj,v_proj,o_proj")
    args = p.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        shutil.rmtree(args.dir, ignore_errors=True)
        _model_dir(os.path.join(args.dir, "model"))
    dist.barrier()
    base = HFSource.from_dir(os.path.join(args.dir, "model"))
    lora = LoraSource(base, parse_lora(args.lora))
    l_sizes, l_seconds, groups = _saves(lora, os.path.join(args.dir, "lora"), args.saves)
    r_sizes, r_seconds, _ = _saves(lora, os.path.join(args.dir, "rewrite"), args.saves, frozen_once=False)
    f_sizes, f_seconds, _ = _saves(base, os.path.join(args.dir, "full"), args.saves)
    if rank == 0:
        state = groups["trainable model"] + groups.get("optim", 0) + groups.get("extra", 0)
        after_first = statistics.median(l_sizes[1:])
        print(
            f"model: transformers Llama, {base.n_params() / 1e6:.1f}M parameters, LoRA {args.lora}: "
            f"{lora.adapter_params / 1e6:.2f}M trainable; {world} ranks, {args.saves} saves each"
        )
        print(
            f"trainable state: {state / 2**20:.2f} MiB (adapters {groups['trainable model'] / 2**20:.2f}, "
            f"optimizer {groups.get('optim', 0) / 2**20:.2f}, run state {groups.get('extra', 0) / 2**20:.2f})"
        )
        print(
            f"LoRA run: first save {l_sizes[0] / 2**20:.1f} MiB, later saves {after_first / 2**20:.1f} MiB each = "
            f"{after_first / state:.3f}x the trainable state (target <= 1.02x)"
        )
        framing = after_first - state - groups["sidecars"]
        print(
            f"  of which: tensor and object bytes {state / 2**20:.2f} MiB; DCP's framing of its "
            f"{groups['records']} records (a torch.save archive each) {framing / 2**10:.0f} KiB "
            f"({framing / groups['records']:.0f} B per record); .metadata and mfsdp.json {groups['sidecars'] / 2**10:.0f} KiB"
        )
        rewrite = statistics.median(r_sizes[1:])
        print(
            f"LoRA run writing the frozen weights at every save (frozen_once=False): {rewrite / 2**20:.1f} MiB "
            f"per save = {rewrite / state:.1f}x, {statistics.median(r_seconds[1:]):.3f} s"
        )
        print(
            f"save time: LoRA run {statistics.median(l_seconds[1:]):.3f} s (first, with its base: "
            f"{l_seconds[0]:.3f} s), full fine-tuning run "
            f"{statistics.median(f_seconds[1:]):.3f} s ({statistics.median(f_sizes[1:]) / 2**20:.1f} MiB per save): "
            f"{statistics.median(l_seconds[1:]) / statistics.median(f_seconds[1:]):.2f}x"
        )
    dist.barrier()
    if rank == 0:
        shutil.rmtree(args.dir, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
