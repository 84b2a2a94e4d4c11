"""What the trainer starts from and reads: ``--data`` token files (exact resume after a kill),
``--init-from`` a checkpoint of any shape (the model config comes from it), ``--model-config``,
``--dtype``; and what it says: the save line, the averaged step time, why it stopped."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mfsdp_core.data import SyntheticText, TokenFile
from mfsdp_core.models.gpt import PRESETS, GPTConfig
from tests.torchrun import (
    failure,
    read_metrics,
    run_train,
)
from tests.warm_train import warm_train_killed

VOCAB = PRESETS["tiny"].vocab_size


def _corpus(path, tokens: int, dtype=np.uint16, vocab: int = VOCAB, seed: int = 0) -> str:
    """A token file with some structure (a noisy repeating walk), so the loss can fall."""
    rng = np.random.default_rng(seed)
    ids = (np.cumsum(rng.integers(1, 4, size=tokens)) % vocab).astype(dtype)
    ids.tofile(path)
    return str(path)


# ---------------------------------------------------------------------------- TokenFile, in-process


def test_token_file_samples_are_windows_shuffled_per_epoch(tmp_path):
    path = _corpus(tmp_path / "t.bin", 1001)
    ids = np.fromfile(path, dtype=np.uint16).astype(np.int64)
    data = TokenFile(path, seq_len=10, vocab=VOCAB, seed=3)
    assert (data.tokens, data.windows) == (1001, 100)
    where = _window_starts(ids, 11)
    epoch0 = [data.sample(i) for i in range(100)]
    starts = sorted(where[s.numpy().tobytes()] for s in epoch0)
    assert starts == list(range(0, 1000, 10))  # every window once per epoch, each token a target once
    again = TokenFile(path, seq_len=10, vocab=VOCAB, seed=3)
    assert all(torch.equal(again.sample(i), epoch0[i]) for i in (0, 57, 99))  # a pure function of the index
    assert torch.equal(data.batch(95, 10)[5:], torch.stack([data.sample(i) for i in range(100, 105)]))
    epoch1 = [data.sample(100 + i) for i in range(100)]
    order0 = [where[s.numpy().tobytes()] for s in epoch0]
    order1 = [where[s.numpy().tobytes()] for s in epoch1]
    assert sorted(order1) == starts and order1 != order0  # reshuffled each epoch
    other_seed = TokenFile(path, seq_len=10, vocab=VOCAB, seed=4)
    assert [where[other_seed.sample(i).numpy().tobytes()] for i in range(100)] != order0


def _window_starts(ids: np.ndarray, n: int) -> dict[bytes, int]:
    """Each ``n``-token window of ``ids`` by its bytes -> where it starts (asserting each is unique,
    which the corpus walk makes so here)."""
    windows = np.lib.stride_tricks.sliding_window_view(ids, n)
    out = {w.tobytes(): i for i, w in enumerate(windows)}
    assert len(out) == len(windows)
    return out


def test_token_file_uint32_and_bad_files_are_one_line(tmp_path):
    path = _corpus(tmp_path / "t32.bin", 500, dtype=np.uint32, vocab=70000)
    data = TokenFile(path, seq_len=16, vocab=70000, dtype="uint32")
    assert data.sample(0).dtype == torch.int64 and int(data.batch(0, 8).max()) < 70000
    with pytest.raises(ValueError, match=r"token id \d+ at token \d+ is outside the model's vocabulary \(256\)"):
        TokenFile(path, seq_len=16, vocab=256, dtype="uint32").batch(0, 8)
    (tmp_path / "odd.bin").write_bytes(b"\0" * 7)
    with pytest.raises(ValueError, match=r"odd.bin: 7 bytes is not a whole number of uint16 token ids"):
        TokenFile(str(tmp_path / "odd.bin"), seq_len=4, vocab=VOCAB)
    with pytest.raises(ValueError, match=r"short.bin: 3 tokens, fewer than one sample of --seq-len 16 \+ 1"):
        TokenFile(_corpus(tmp_path / "short.bin", 3), seq_len=16, vocab=VOCAB)
    with pytest.raises(ValueError, match=r"none.bin: No such file"):
        TokenFile(str(tmp_path / "none.bin"), seq_len=4, vocab=VOCAB)


# ---------------------------------------------------------------------------- trainer runs

DATA_ARGS = ("--model", "tiny", "--steps", "8", "--save-every", "2", "--batch-size", "4", "--seq-len", "32")


@pytest.mark.heavy
def test_data_run_killed_and_resumed_is_bitwise_an_uninterrupted_one(tmp_path):
    corpus = _corpus(tmp_path / "train.bin", 3000)  # 93 windows of 32: the 8 x 4 samples span one epoch change
    common = (*DATA_ARGS, "--data", corpus)
    a = run_train(
        2, *common, "--ckpt-dir", str(tmp_path / "a"), "--metrics", str(tmp_path / "a.jsonl"), "--log-every", "4"
    )
    assert a.returncode == 0, failure(a)
    assert "finished: step 8 of 8" in a.stdout
    assert any(
        line.startswith("saved step_000008: ") and f" to {tmp_path / 'a' / 'step_000008'}" in line
        for line in a.stdout.splitlines()
    ), a.stdout
    assert " ms/step | " in a.stdout
    b_metrics = tmp_path / "b.jsonl"
    killed_at = warm_train_killed(
        2, b_metrics, 5, *common, "--ckpt-dir", str(tmp_path / "b"), "--metrics", str(b_metrics)
    )
    assert 5 <= killed_at < 8, f"the run was not interrupted mid-way (last step {killed_at})"
    b = run_train(2, *common, "--ckpt-dir", str(tmp_path / "b"), "--metrics", str(tmp_path / "b.jsonl"), "--resume")
    assert b.returncode == 0, failure(b)
    ma, mb = read_metrics(tmp_path / "a.jsonl"), read_metrics(tmp_path / "b.jsonl")
    assert [ma[s] for s in range(1, 9)] == [mb[s] for s in range(1, 9)]  # exact floats: bitwise
    # the first loss is the model's on the file's first batch: the trainer read the file's samples
    other = _corpus(tmp_path / "other.bin", 3000, seed=1)
    refused = run_train(None, *common[:-1], other, "--ckpt-dir", str(tmp_path / "b"), "--resume", "--steps", "8")
    assert refused.returncode == 1 and refused.stderr.count("\n") == 1, failure(refused)
    assert f"--data {corpus} (uint16, 3000 tokens) (this run: {other} (uint16, 3000 tokens))" in refused.stderr


def test_data_first_loss_is_the_models_loss_on_the_files_first_batch(tmp_path):
    corpus = _corpus(tmp_path / "train.bin", 2000)
    run = run_train(
        None,
        "--model",
        "tiny",
        "--steps",
        "1",
        "--batch-size",
        "2",
        "--seq-len",
        "16",
        "--data",
        corpus,
        "--ckpt-dir",
        str(tmp_path / "run"),
        "--metrics",
        str(tmp_path / "m.jsonl"),
    )
    assert run.returncode == 0, failure(run)
    from mfsdp_ckpt.read.manifest import read_manifest
    from mfsdp_core.models.gpt import GPTModel

    # the weights before the step are the seeded init (seed 0): rebuild them and score the batch
    torch.manual_seed(0)
    model = GPTModel(PRESETS["tiny"])
    batch = TokenFile(corpus, seq_len=16, vocab=VOCAB).batch(0, 2)
    with torch.no_grad():
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)).item()
    first = read_metrics(tmp_path / "m.jsonl")[1]["loss"]
    # the sharded model computes the same math in another order (fused buffers): fp32 rounding
    assert abs(first - loss) <= 1e-5 * abs(loss), (first, loss)
    synthetic = SyntheticText(VOCAB, 16, seed=0).batch(0, 2)
    with torch.no_grad():
        logits = model(synthetic[:, :-1])
        loss_synthetic = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), synthetic[:, 1:].reshape(-1)).item()
    assert abs(first - loss_synthetic) > 1e-3  # and not the synthetic stream's
    assert read_manifest(str(tmp_path / "run" / "step_000001"))["run_config"]["data"].startswith(corpus)


def test_bad_data_flags_are_one_line_before_training(tmp_path):
    (tmp_path / "odd.bin").write_bytes(b"\0" * 9)
    run = run_train(None, "--steps", "1", "--data", str(tmp_path / "odd.bin"))
    assert run.returncode == 1 and run.stderr.count("\n") == 1
    assert run.stderr.startswith(f"error: --data {tmp_path / 'odd.bin'}: 9 bytes is not a whole number of uint16")
    wide = _corpus(tmp_path / "wide.bin", 400, dtype=np.uint32, vocab=70000)
    run = run_train(
        None, "--steps", "1", "--batch-size", "2", "--seq-len", "16", "--data", wide, "--data-dtype", "uint32"
    )
    assert run.returncode == 1 and run.stderr.count("\n") == 1, failure(run)
    assert "is outside the model's vocabulary (256)" in run.stderr


@pytest.mark.heavy
def test_init_from_a_non_preset_import_hf_output_trains_with_its_config(tmp_path):
    pytest.importorskip("transformers")
    from click.testing import CliRunner

    from cli.main import main
    from tests.mfsdp_ckpt.hf.util import hf_config, random_hf_model, save_hf

    # a Llama of no preset's shape: 3 layers, hidden 48, 6 heads in 3 KV groups, vocab 300
    hf = random_hf_model(
        hf_config(
            "llama",
            vocab_size=300,
            hidden_size=48,
            intermediate_size=80,
            num_hidden_layers=3,
            num_attention_heads=6,
            num_key_value_heads=3,
            max_position_embeddings=64,
        )
    )
    save_hf(hf, str(tmp_path / "hf"))
    result = CliRunner().invoke(main, ["import-hf", str(tmp_path / "hf"), str(tmp_path / "ckpt")])
    assert result.exit_code == 0, result.output
    run = run_train(
        2,
        "--init-from",
        str(tmp_path / "ckpt"),
        "--steps",
        "3",
        "--batch-size",
        "2",
        "--seq-len",
        "32",
        "--metrics",
        str(tmp_path / "m.jsonl"),
        "--ckpt-dir",
        str(tmp_path / "run"),
    )
    assert run.returncode == 0, failure(run)
    # the header names the model its checkpoint records (it said "model custom" before)
    assert f"model llama (imported from {tmp_path / 'hf'})" in run.stdout, run.stdout
    assert f"initialised from the weights of {tmp_path / 'ckpt'}" in run.stdout
    # the first loss is the HF model's on the same batch: the imported weights are what trains
    batch = SyntheticText(300, 32, seed=0).batch(0, 2)
    with torch.no_grad():
        logits = hf(batch[:, :-1]).logits
        expected = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)).item()
    first = read_metrics(tmp_path / "m.jsonl")[1]["loss"]
    # fp32 both sides, other kernels (fused QKV, another attention): 1e-5 relative
    assert abs(first - expected) <= 1e-5 * expected, (first, expected)
    manifest = json.loads((tmp_path / "run" / "step_000003" / "mfsdp.json").read_text())
    assert manifest["model_config"]["num_layers"] == 3 and manifest["model_config"]["vocab_size"] == 300
    # a preset that does not match is refused, naming the differences
    wrong = run_train(None, "--init-from", str(tmp_path / "ckpt"), "--model", "tiny", "--steps", "1")
    assert wrong.returncode == 1 and "was written for another model config: " in wrong.stderr
    assert wrong.stderr.count("\n") == 1


def test_model_config_file_ours_or_hf_and_bad_ones(tmp_path, capsys):
    from cli.model_source import model_of_run
    from cli.train import parse_args

    config = GPTConfig(
        vocab_size=128,
        hidden_size=32,
        num_layers=1,
        num_attention_heads=2,
        num_query_groups=1,
        kv_channels=16,
        ffn_hidden_size=64,
        seq_length=32,
    )
    (tmp_path / "ours.json").write_text(json.dumps(config.to_dict()))
    run = run_train(
        None,
        "--model-config",
        str(tmp_path / "ours.json"),
        "--steps",
        "2",
        "--batch-size",
        "2",
        "--seq-len",
        "16",
        "--dtype",
        "bf16",
        "--stop-at",
        "1",
        "--log-every",
        "5",
    )
    assert run.returncode == 0, failure(run)
    assert "model ours.json, 17,504 parameters" in run.stdout  # 2 x 128 x 32 embeddings + one 32-wide layer
    assert (
        "stopped at step 1 of 2: reached --stop-at 1; no --ckpt-dir, so there is no checkpoint to continue from"
        in run.stdout
    )
    assert "step     1 | loss" in run.stdout  # the last step is logged whatever --log-every says
    # a Hugging Face config.json, and a checkpoint manifest holding model_config
    hf = {
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    }
    (tmp_path / "config.json").write_text(json.dumps(hf))
    got, name = model_of_run(None, str(tmp_path / "config.json"))
    assert name == "config.json" and (
        got.vocab_size,
        got.hidden_size,
        got.num_query_groups,
        got.kv_channels,
        got.ffn_hidden_size,
        got.add_qkv_bias,
    ) == (64, 32, 2, 8, 48, True)
    (tmp_path / "mfsdp.json").write_text(json.dumps({"format_version": 2, "model_config": config.to_dict()}))
    assert model_of_run(None, str(tmp_path / "mfsdp.json"))[0] == config
    assert model_of_run(None, None)[1] == "tiny" and model_of_run("tiny-moe", None)[1] == "tiny-moe"
    for text, expected in (
        (None, "No such file"),
        ("{", "not a JSON file"),
        ("[1]", "expected a JSON object, got list"),
        ('{"hidden": 3}', "not a model config: unknown GPTConfig key(s): hidden"),
        ('{"model_type": "bert"}', "unknown architecture (model_type='bert'"),
    ):
        path = tmp_path / "missing.json" if text is None else tmp_path / "bad.json"
        if text is not None:
            path.write_text(text)
        with pytest.raises(ValueError) as e:
            model_of_run(None, str(path))
        assert str(e.value).startswith(f"--model-config {path}: ") and expected in str(e.value), str(e.value)
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="--model and --model-config exclude each other"):
        model_of_run("tiny", str(tmp_path / "ours.json"))
    # through the trainer: one line, exit 1, nothing trained
    bad = run_train(None, "--model-config", str(tmp_path / "missing.json"), "--steps", "1")
    assert (
        bad.returncode == 1
        and bad.stderr == f"error: --model-config {tmp_path / 'missing.json'}: No such file or directory\n"
    )
    assert bad.stdout == ""
    # --dtype: the short names and the long ones, nothing else
    assert (
        parse_args(["--dtype", "bf16"]).param_dtype
        == "bfloat16"
        == parse_args(["--param-dtype", "bfloat16"]).param_dtype
    )
    assert parse_args(["--dtype", "fp32"]).param_dtype == "float32"
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--dtype", "fp16"])
    assert (
        exit_.value.code == 2 and "argument --dtype/--param-dtype: 'fp16': one of fp32, bf16" in capsys.readouterr().err
    )


def test_resume_takes_the_model_from_the_checkpoint_and_says_when_there_is_nothing_to_do(tmp_path):
    ckpt = str(tmp_path / "run")
    first = run_train(
        None, "--model", "tiny-moe", "--steps", "2", "--batch-size", "2", "--seq-len", "16", "--ckpt-dir", ckpt
    )
    assert first.returncode == 0, failure(first)
    again = run_train(None, "--steps", "2", "--batch-size", "2", "--seq-len", "16", "--ckpt-dir", ckpt, "--resume")
    assert again.returncode == 0, failure(again)
    assert (
        "model tiny-moe, " in again.stdout and "nothing to do: the run is already at step 2 (--steps 2)" in again.stdout
    )
    assert os.listdir(ckpt).count("step_000002") == 1
