"""``cli.train --mcore-config``: a genuine Megatron-Core ``GPTModel`` (MoE, EP 2) trained by the
trainer on 2 ranks, stopped, resumed on 1 rank from the recorded model source alone; the resumed
losses equal an uninterrupted 1-rank run's; the checkpoint is canonical (``export-mcore`` and
``export-hf`` take it). Without megatron-core, ``--mcore-config`` is refused in one line naming
the extra."""

from __future__ import annotations

import json
import subprocess
import sys

from mfsdp_ckpt.manifest import read_manifest
from tests.torchrun import ENV, ROOT, failure, read_metrics, run_train

ARGS = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "num_query_groups": 2, "ffn_hidden_size": 64,
        "vocab_size": 64, "seq_length": 32, "num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 32}
COMMON = ("--steps", "4", "--batch-size", "4", "--seq-len", "16", "--log-every", "10")


def test_mcore_moe_trains_resumes_at_another_world_size_and_exports(tmp_path):
    config = tmp_path / "gpt.json"
    config.write_text(json.dumps(ARGS))
    ckpt, whole = tmp_path / "ckpt", tmp_path / "whole.jsonl"
    run = run_train(2, "--mcore-config", str(config), "--ep", "2", *COMMON, "--stop-at", "2", "--ckpt-dir", str(ckpt),
                    "--save-every", "2", "--metrics", str(tmp_path / "a.jsonl"))
    assert run.returncode == 0, failure(run)
    assert "model gpt.json (megatron-core), 33,184 parameters, world size 2, EP 2" in run.stdout
    manifest = read_manifest(str(ckpt / "step_000002"))
    assert manifest["model_source"]["kind"] == "megatron-core" and manifest["model_source"]["args"] == ARGS
    assert manifest["model_config"]["num_experts"] == 4
    resumed = run_train(1, *COMMON, "--ckpt-dir", str(ckpt), "--resume", "--metrics", str(tmp_path / "b.jsonl"))
    assert resumed.returncode == 0, failure(resumed)
    assert "resumed from" in resumed.stdout and "finished: step 4 of 4" in resumed.stdout
    straight = run_train(1, "--mcore-config", str(config), *COMMON, "--metrics", str(whole))
    assert straight.returncode == 0, failure(straight)
    got = {**read_metrics(tmp_path / "a.jsonl"), **read_metrics(tmp_path / "b.jsonl")}
    want = read_metrics(whole)
    assert sorted(got) == sorted(want) == [1, 2, 3, 4]
    for step in want:  # 2 ranks (EP 2) then 1 rank vs 1 rank: summation order only
        assert abs(got[step]["loss"] - want[step]["loss"]) <= 1e-5 * abs(want[step]["loss"]), (step, got[step], want[step])
    for cmd in (["export-mcore", str(ckpt / "latest"), str(tmp_path / "mc")],
                ["export-hf", str(ckpt / "latest"), str(tmp_path / "hf"), "--arch", "mixtral"]):
        out = subprocess.run([sys.executable, "-m", "cli.main", *cmd], cwd=ROOT, env=ENV, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr


def test_mcore_config_without_megatron_core_is_refused_in_one_line(tmp_path):
    config = tmp_path / "gpt.json"
    config.write_text(json.dumps(ARGS))
    code = ("import sys; sys.modules['megatron'] = None; from cli.train import main; "
            f"sys.exit(main(['--mcore-config', {str(config)!r}, '--steps', '1', '--ckpt-dir', {str(tmp_path / 'ck')!r}]))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True, text=True)
    assert out.returncode == 1, out.stderr
    assert out.stderr.strip() == (f"error: --mcore-config {config}: megatron-core is not installed "
                                  "(pip install 'mfsdp-ckpt[mcore]')"), out.stderr
    assert not (tmp_path / "ck").exists()
