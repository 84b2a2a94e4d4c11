"""Genuine torchtitan 0.3.0 on CPU gloo ranks: its llama3 ``debugmodel``, parallelised by its own
``parallelize_llama`` (FSDP2's ``fully_shard``), its AdamW ``OptimizersContainer``, LR scheduler,
``ParallelAwareDataloader`` and ``CheckpointManager``. The tests and the README's round trip run
it; from the repository root::

    .venv/bin/torchrun --standalone --nproc-per-node 2 -m tests.titan.llama save /tmp/titan_run
    .venv/bin/torchrun --standalone --nproc-per-node 3 -m tests.titan.llama load /tmp/titan_w3 --exclude dataloader

What it takes to run torchtitan here, all done by :func:`install_cpu_shims` (in the test process,
never by the library):

* ``import torchtitan.models.llama3`` imports ``triton`` only through
  ``torchtitan.distributed.minimal_async_ep`` (expert parallelism's kernels): ``triton`` is made
  unimportable and that package a stub exporting the four names the model code imports;
* torchtitan builds its device mesh on ``torchtitan.tools.utils.device_type``, ``"cuda"`` when no
  accelerator is present: set to ``"cpu"``;
* the forward runs with ``attn_backend="flex"`` but eagerly (``flex_attention`` and
  ``create_block_mask`` as they are, not torch.compile'd: compiling them costs about 30 s per rank
  on CPU); backward through flex attention is not supported on CPU, so a step takes synthetic
  gradients (:func:`synthetic_grads`) and ``optimizers.step()``.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import logging
import sys
import types
import warnings
from typing import Any

import torch
import torch.distributed as dist

#: what the stub of ``torchtitan.distributed.minimal_async_ep`` exports
EP_NAMES = ("combine_op", "dispatch_op", "init_buffer")
SEQ_LEN = 16
BATCH = 2
VOCAB = 2048  # the debugmodel's


def install_cpu_shims() -> None:
    """Make torchtitan's llama3 importable and runnable on CPU (see the module docstring)."""
    name = "torchtitan.distributed.minimal_async_ep"
    if name not in sys.modules:
        sys.modules["triton"] = None  # type: ignore[assignment] - an import of it raises ImportError
        stub = types.ModuleType(name)

        def unavailable(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(f"{name} is stubbed out (no triton): expert parallelism is not available")

        for fn in EP_NAMES:
            setattr(stub, fn, unavailable)
        stub.MinimalAsyncEPDispatchMetadata = type("MinimalAsyncEPDispatchMetadata", (), {})
        sys.modules[name] = stub
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.models.common.attention as attention
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    parallel_dims.device_type = "cpu"
    attention.FlexAttention._compiled_flex_attn = staticmethod(flex_attention)
    attention._compiled_create_block_mask = create_block_mask


class TrainState:
    """The trainer's own ``train_state`` entry (torchtitan's ``Trainer.state_dict``)."""

    def __init__(self) -> None:
        self.step = 0
        self.ntokens_seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.ntokens_seen = state["step"], state["ntokens_seen"]


class Tokens(torch.utils.data.IterableDataset):
    """Token rows for this data-parallel rank (the dataloader's position is what is saved)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __iter__(self):
        i = self.rank * 1000
        while True:
            yield (torch.arange(i, i + SEQ_LEN) * 7919) % VOCAB
            i += 1


@dataclasses.dataclass
class Titan:
    """One rank's torchtitan training state, as its trainer holds it."""

    model: torch.nn.Module
    optimizers: Any
    lr_schedulers: Any
    dataloader: Any
    train_state: TrainState
    batches: Any

    def checkpointer(self, folder: str, exclude: tuple[str, ...] = ()) -> Any:
        from torchtitan.components.checkpoint import CheckpointManager

        config = CheckpointManager.Config(
            enable=True, folder=folder, interval=1, keep_latest_k=0, exclude_from_loading=list(exclude)
        )
        return config.build(
            dataloader=self.dataloader,
            model_parts=[self.model],
            optimizers=self.optimizers,
            lr_schedulers=self.lr_schedulers,
            states={"train_state": self.train_state},
            sd_adapter=None,
        )


def build(seed: int) -> Titan:
    """The debugmodel on this process group's ranks (FSDP2 over all of them), as torchtitan's
    trainer builds it: on the meta device, parallelised, materialised, initialised."""
    install_cpu_shims()
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.llama3 import model_registry

    spec = model_registry("debugmodel", attn_backend="flex")
    for layer in spec.model.layers:  # what update_from_config does for training.seq_len
        layer.attention.rope = dataclasses.replace(layer.attention.rope, max_seq_len=SEQ_LEN)
    with torch.device("meta"):
        model = spec.model.build()
    parallelism = ParallelismConfig(spmd_backend="partial_dtensor")  # plain FSDP2 over the dp mesh
    world, rank = dist.get_world_size(), dist.get_rank()
    model = spec.parallelize_fn(
        model,
        parallel_dims=ParallelDims.from_config(parallelism, world),
        training=TrainingConfig(mixed_precision_param="float32"),
        parallelism=parallelism,
        compile_config=CompileConfig(),
        ac_config=None,
        dump_folder="/tmp",
    )
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    optimizer_config = default_adamw(lr=8e-4)
    optimizer_config.implementation = "for-loop"  # fused AdamW is CUDA-only
    optimizers = optimizer_config.build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.8).build(
        optimizers=optimizers, training_steps=10
    )
    dataloader = ParallelAwareDataloader(Tokens(rank), dp_rank=rank, dp_world_size=world, batch_size=BATCH)
    return Titan(model, optimizers, schedulers, dataloader, TrainState(), iter(dataloader))


def synthetic_grads(model: torch.nn.Module, step: int) -> None:
    """Every parameter's gradient: the same full tensor on every rank (seeded by ``step`` and the
    parameter's index), this rank's shard of it."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for i, p in enumerate(model.parameters()):
        g = torch.Generator().manual_seed(1000 * step + i)
        full = torch.randn(p.shape, generator=g) * 1e-2
        p.grad = distribute_tensor(full, p.device_mesh, p.placements) if isinstance(p, DTensor) else full


def train_step(titan: Titan) -> None:
    """One step: a forward on the next batch (no autograd: see the module docstring), synthetic
    gradients, ``optimizers.step()``, the scheduler's step."""
    from torch.distributed.fsdp import FSDPModule

    tokens = next(titan.batches)
    positions = torch.arange(tokens.shape[1]).expand(tokens.shape[0], -1)
    with torch.no_grad():
        logits = titan.model(tokens, None, titan.model.get_attention_masks(positions))
    assert logits.shape == (tokens.shape[0], tokens.shape[1], VOCAB) and bool(logits.isfinite().all())
    for module in titan.model.modules():  # the root keeps its parameters gathered after a forward
        if isinstance(module, FSDPModule):
            module.reshard()
    titan.train_state.step += 1
    synthetic_grads(titan.model, titan.train_state.step)
    titan.optimizers.step()
    titan.lr_schedulers.step()
    titan.optimizers.zero_grad()
    titan.train_state.ntokens_seen += tokens.numel()


def _full(value: Any) -> Any:
    """A DTensor's full tensor (collective), a tensor's copy, anything else as it is."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value.full_tensor().detach().clone()
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def full_state(titan: Titan, batches: Any) -> dict[str, Any]:
    """Everything torchtitan checkpoints, as full tensors and objects (collective): the model under
    its state-dict names (``wq``/``wk``/``wv``, from the fused ``wqkv``'s hook) and its parameters
    (``param.<fqn>``: ``wqkv`` itself), the optimizers' flat state dict (``optimizer.<key>``), the
    scheduler, the learning rates, the train state, and the next batch ``batches`` gives this
    rank (where its dataloader stands)."""
    out = {k: _full(v) for k, v in titan.model.state_dict().items()}
    out.update((f"param.{n}", _full(p)) for n, p in titan.model.named_parameters())
    out.update((f"optimizer.{k}", _full(v)) for k, v in titan.optimizers.state_dict().items())
    out["lr_scheduler"] = titan.lr_schedulers.state_dict()
    out["lr"] = [g["lr"] for o in titan.optimizers for g in o.param_groups]
    out["train_state"] = titan.train_state.state_dict()
    out["next_batch"] = next(batches)
    return out


def train_and_save(folder: str, steps: int = 2, seed: int = 0) -> dict[str, Any]:
    """Train ``steps`` steps and save with torchtitan's ``CheckpointManager`` into
    ``folder/step-<steps>``; the state saved (rank 0's, with every rank's dataloader state)."""
    titan = build(seed)
    for _ in range(steps):
        train_step(titan)
    checkpointer = titan.checkpointer(folder)
    assert checkpointer.save(titan.train_state.step)
    checkpointer.close()
    return _gathered(full_state(titan, titan.batches))


def load(folder: str, exclude: tuple[str, ...] = (), seed: int = 123) -> dict[str, Any]:
    """A fresh build (another seed) loads ``folder``'s latest ``step-<n>`` with torchtitan's
    ``CheckpointManager.load``; the state it then holds, as :func:`train_and_save` returns it."""
    titan = build(seed)
    checkpointer = titan.checkpointer(folder, exclude)
    assert checkpointer.load()
    checkpointer.close()
    return _gathered(full_state(titan, iter(titan.dataloader)))  # a loaded dataloader resumes in a new iterator


def _gathered(state: dict[str, Any]) -> dict[str, Any] | None:
    """Rank 0's state with every rank's next batch (``next_batch`` a list, rank order); None on
    the other ranks (the full tensors are the same on all)."""
    batches: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(batches, state["next_batch"])
    state["next_batch"] = batches
    return state if dist.get_rank() == 0 else None


def digest(state: dict[str, Any]) -> str:
    """A SHA-256 over the model's and the optimizer's entries of :func:`full_state` (names, dtypes,
    shapes, bytes; hyper-parameters by ``repr``): equal digests, bitwise equal state."""
    h = hashlib.sha256()
    for key in sorted(k for k in state if "." in k):  # the model, its parameters, the optimizer's entries
        value = state[key]
        h.update(key.encode())
        if isinstance(value, torch.Tensor):
            h.update(f"{value.dtype}{tuple(value.shape)}".encode())
            h.update(value.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
        else:
            h.update(repr(value).encode())
    return h.hexdigest()[:16]


def main(argv: list[str]) -> None:
    """``save DIR`` (2 steps, then torchtitan saves ``DIR/step-2``) or ``load DIR [--exclude
    dataloader]`` (torchtitan loads DIR's latest step), under torchrun; rank 0 prints what it
    holds (a digest of the model and optimizer, the scheduler, the train state, the next batch)."""
    parser = argparse.ArgumentParser(prog="python -m tests.titan.llama")
    parser.add_argument("command", choices=("save", "load"))
    parser.add_argument("folder")
    parser.add_argument("--exclude", action="append", default=[], help="what load leaves out (e.g. dataloader)")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", category=UserWarning)  # CPU notices of DTensor, flex attention, torchdata
    logging.getLogger().setLevel(logging.ERROR)  # torchtitan logs its progress on the root logger
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    if args.command == "save":
        state = train_and_save(args.folder)
    else:
        state = load(args.folder, exclude=tuple(args.exclude))
    if state is not None:
        print(
            f"torchtitan {args.command.rstrip('e')}ed {args.folder} on {dist.get_world_size()} ranks: model and optimizer "
            f"sha256 {digest(state)}, lr_scheduler {state['lr_scheduler']}, train_state {state['train_state']}, "
            f"next batch of rank 0 {state['next_batch'][0][0, :4].tolist()}"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
