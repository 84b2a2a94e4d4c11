"""What the launcher's pre-flight imports: refusing a reference GPT run before any rank starts (a
``--resume`` checkpoint whose recorded setting the new world size does not take, another model,
other settings; a ``--data`` file or ``--model-config`` that cannot be one; a ``--seq-len`` over the
model's) reads the manifest, the model config and the file's size, and needs no torch (about 1.7 s
to import, of a refusal that should take under 1.5 s), let alone ``torch.distributed.checkpoint``. ``import mfsdp_ckpt`` (and
its ``hf`` and ``mcore`` packages) import it only when ``save``, ``load``, ``export``... are first
used, and those still resolve to the same functions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DCP = "torch.distributed.checkpoint"

# the trainer's front end in a fresh interpreter, with the rank launcher replaced by a failure (the
# pre-flight must refuse first); prints whether DCP was imported by the time it returned
_PROBE = textwrap.dedent(
    """
    import sys
    import cli.train

    def no_launch(*args, **kwargs):
        raise AssertionError("a rank was launched")

    cli.train.launch = no_launch
    try:
        code = cli.train.main(sys.argv[1:])
    except SystemExit as e:
        code = e.code
    print("DCP=" + str("torch.distributed.checkpoint" in sys.modules), file=sys.stderr)
    print("TORCH=" + str("torch" in sys.modules), file=sys.stderr)
    sys.exit(code)
    """
)

# the lazily imported public names: absent from sys.modules until used, then the same objects
_LAZY_NAMES = textwrap.dedent(
    """
    import sys
    import mfsdp_ckpt, mfsdp_ckpt.hf, mfsdp_ckpt.mcore, mfsdp_ckpt.read.manifest, mfsdp_ckpt.mcore.config
    assert "torch.distributed.checkpoint" not in sys.modules, "imported by the packages"
    assert "mfsdp_ckpt.sharded.save" not in sys.modules
    for package in (mfsdp_ckpt, mfsdp_ckpt.hf, mfsdp_ckpt.mcore):
        assert set(package.__all__) <= set(dir(package)), package.__name__
    import mfsdp_ckpt.mcore.to_hf  # imports the submodule mfsdp_ckpt.hf.export first
    from mfsdp_ckpt import AsyncSaveHandle, async_save, load, save
    from mfsdp_ckpt.hf import ExportResult, export, import_
    from mfsdp_ckpt.mcore import export_mcore, import_mcore
    modules = sys.modules
    assert save is modules["mfsdp_ckpt.sharded.save"].save and mfsdp_ckpt.save is save
    assert load is modules["mfsdp_ckpt.sharded.load"].load and mfsdp_ckpt.load is load
    assert async_save is modules["mfsdp_ckpt.sharded.async_save"].async_save
    assert AsyncSaveHandle is modules["mfsdp_ckpt.sharded.async_save"].AsyncSaveHandle
    assert export is modules["mfsdp_ckpt.hf.export"].export and mfsdp_ckpt.hf.export is export
    assert ExportResult is modules["mfsdp_ckpt.hf.export"].ExportResult
    assert import_ is modules["mfsdp_ckpt.hf.import_"].import_ and mfsdp_ckpt.hf.import_ is import_
    assert export_mcore is modules["mfsdp_ckpt.mcore.export"].export_mcore
    assert import_mcore is modules["mfsdp_ckpt.mcore.import_"].import_mcore
    for package in (mfsdp_ckpt, mfsdp_ckpt.hf, mfsdp_ckpt.mcore):
        try:
            package.no_such_name
        except AttributeError:
            pass
        else:
            raise AssertionError(package.__name__ + ".no_such_name resolved")
    print("OK")
    """
)


def _python(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def tiny_step(tmp_path_factory) -> str:
    """The step-2 checkpoint of a finished 1-process run of the tiny preset, ``--batch-size 4``."""
    from tests.torchrun import failure, run_train

    run = tmp_path_factory.mktemp("tiny") / "run"
    out = run_train(
        None, "--model", "tiny", "--steps", "2", "--batch-size", "4", "--seq-len", "16", "--ckpt-dir", str(run)
    )
    assert out.returncode == 0, failure(out)
    return os.path.realpath(run / "step_000002")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    """A Hugging Face Llama directory of a config.json alone (no weights: a fresh model)."""
    path = tmp_path_factory.mktemp("llama")
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64}
    config.update(intermediate_size=128, num_attention_heads=4, num_hidden_layers=2, vocab_size=256)
    (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 128}))
    return str(path)


@pytest.fixture(scope="module")
def mcore_config(tmp_path_factory) -> str:
    """A Megatron-Core arguments file whose RoPE base is NaN (no model runs with it)."""
    path = tmp_path_factory.mktemp("mcore") / "args.json"
    args = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "ffn_hidden_size": 128}
    path.write_text(json.dumps({**args, "padded_vocab_size": 256, "seq_length": 64, "rotary_base": float("nan")}))
    return str(path)


def test_the_packages_import_dcp_only_when_save_load_or_export_is_used() -> None:
    out = _python("-c", _LAZY_NAMES)
    assert out.returncode == 0 and out.stdout.strip() == "OK", out.stderr


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--nproc-per-node", "3", "--resume", "{step}"],
            "error: --batch-size 4 (recorded in {step}/mfsdp.json) must be a multiple of world size x "
            "--micro-batches (3 x 1)",
        ),
        (
            ["--nproc-per-node", "2", "--model", "tiny-moe", "--resume", "{step}"],
            "error: --resume: {step} was written for another model config: ",
        ),
        (
            ["--nproc-per-node", "2", "--lr", "0.5", "--resume", "{step}"],
            "error: --resume: {step} was written with other settings: --lr 0.003 (this run: 0.5)",
        ),
        (
            ["--nproc-per-node", "2", "--init-from", "{step}", "--model", "tiny-moe"],
            "error: --init-from: {step} was written for another model config: ",
        ),
        (
            ["--nproc-per-node", "2", "--resume", "{step}", "--seq-len", "4096", "--allow-change", "seq-len"],
            "error: --seq-len 4096 exceeds the model's seq_length ",
        ),
        (["--nproc-per-node", "2", "--data", "{step}/no.bin"], "error: --data {step}/no.bin: No such file"),
        (["--nproc-per-node", "2", "--model-config", "{step}/no.json"], "error: --model-config {step}/no.json: "),
        (
            ["--nproc-per-node", "2", "--hf-model", "{hf}", "--seq-len", "4096"],
            "error: --seq-len 4096 exceeds the model's seq_length 128",
        ),
        (["--nproc-per-node", "2", "--mcore-config", "{mcore}"], "error: --mcore-config {mcore}: rotary_base=nan"),
    ],
    ids=[
        "recorded-setting",
        "model",
        "settings",
        "init-from-model",
        "seq-len",
        "data",
        "model-config",
        "hf-seq-len",
        "mcore-config",
    ],
)
def test_a_refused_run_imports_no_torch(
    tiny_step: str, hf_dir: str, mcore_config: str, flags: list[str], message: str
) -> None:
    names = {"step": tiny_step, "hf": hf_dir, "mcore": mcore_config}
    out = _python("-c", _PROBE, *(f.format(**names) for f in flags))
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1 and len(lines) == 3, out.stderr
    assert lines[0].startswith(message.format(**names)), out.stderr
    assert lines[1] == "DCP=False", f"the pre-flight imported {DCP}"
    assert lines[2] == "TORCH=False", "the pre-flight imported torch"
