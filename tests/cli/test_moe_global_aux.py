"""``--moe-aux-loss global``: the load-balancing loss counts the tokens of every rank, so a run at
(W 4, EP 2) computes the loss and the gradients of one process on the whole batch; the per-rank
loss (the default) cannot, as it is a non-linear function of each rank's token counts.

Plain SGD (``--optimizer sgd``: the step is linear in the gradient, so differences are not
amplified by Adam's normalisation), 6 steps, the same global batch in every run (the trainer
gives rank r the r-th slice of it). The bound 1e-6 relative: what remains is the order of
floating-point sums (the 4-rank run reduces gradients in rank order, one process sums over all
tokens at once); measured up to 1.8e-7 on the loss and 0 on the gradient norm, while the
per-rank loss differs by up to 1.2e-5 (loss) and 4.1e-4 (gradient norm)."""

from __future__ import annotations

import pytest

from tests.torchrun import failure, read_metrics, run_train

RUN = (
    "--model", "tiny-moe", "--optimizer", "sgd", "--lr", "0.5", "--warmup", "0",
    "--steps", "6", "--batch-size", "8", "--seq-len", "16", "--seed", "3",
)  # fmt: skip
BOUND = 1e-6


def _train(nproc: int, metrics, *extra: str) -> dict:
    run = run_train(nproc, *RUN, "--metrics", str(metrics), *extra)
    assert run.returncode == 0, failure(run)
    return read_metrics(metrics)


def _worst(a: dict, b: dict, field: str) -> float:
    return max(abs(a[s][field] - b[s][field]) / abs(b[s][field]) for s in b)


@pytest.mark.heavy
def test_global_aux_loss_at_w4_ep2_is_one_process_on_the_whole_batch(tmp_path):
    one = _train(1, tmp_path / "one.jsonl")
    assert sorted(one) == list(range(1, 7))
    glob = _train(4, tmp_path / "global.jsonl", "--ep", "2", "--moe-aux-loss", "global")
    local = _train(4, tmp_path / "local.jsonl", "--ep", "2")
    assert _worst(glob, one, "loss") <= BOUND and _worst(glob, one, "grad_norm") <= BOUND
    # the per-rank loss is a different objective: it cannot reach that bound
    assert _worst(local, one, "loss") > 10 * BOUND or _worst(local, one, "grad_norm") > 10 * BOUND


@pytest.mark.heavy  # slow (the inner loop's 8 minutes); CI runs it
def test_global_aux_loss_is_refused_for_a_transformers_model(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16,
    )  # fmt: skip
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "hf")
    run = run_train(1, "--hf-model", str(tmp_path / "hf"), "--steps", "1", "--moe-aux-loss", "global")
    assert run.returncode == 1, failure(run)
    error = "error: --moe-aux-loss global: only the reference GPT's MoE layers have it, not transformers models"
    assert run.stderr.count(error) == 1, failure(run)  # rank 0 speaks
