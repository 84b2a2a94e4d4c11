"""The trainer's everyday flows as a user meets them: ``--help`` / ``--version`` and the refusals the
flags alone decide answer without torch (and before any rank starts), a resume from a given
checkpoint path needs no ``--ckpt-dir``, a refusal creates nothing, an ``--init-from`` of a
Hugging Face directory points to the way that reads it, and what the model and the start checkpoint
decide (another model, other settings, ``--ep 2`` of fused experts, hostile config values) is
refused by the launcher before it launches any rank."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# run the trainer's front end in a fresh interpreter; print whether torch (or the project's heavy
# packages) were imported by the time it returned
_PROBE = """
import sys
from cli.train import main
try:
    code = main(sys.argv[1:])
except SystemExit as e:
    code = e.code
heavy = sorted(m for m in ("torch", "mfsdp_core", "mfsdp_ckpt") if m in sys.modules)
print("HEAVY=" + ",".join(heavy), file=sys.stderr)
sys.exit(code)
"""


def _front_end(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", _PROBE, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.parametrize("flag", ["--help", "--version"])
def test_help_and_version_import_no_torch(flag: str) -> None:
    out = _front_end(flag)
    assert out.returncode == 0, out.stderr
    assert "mfsdp-train" in out.stdout
    assert out.stderr.strip().splitlines()[-1] == "HEAVY=", out.stderr


def test_the_light_parser_names_what_the_runtime_has() -> None:
    """The presets, strategies, default policy and token dtypes ``--help`` lists without torch are
    the runtime's own."""
    from cli import train_args
    from mfsdp_ckpt.format.names import MANIFEST_NAME, METADATA_NAME
    from mfsdp_core.data import TOKEN_DTYPES
    from mfsdp_core.models.gpt import PRESETS
    from mfsdp_core.plan import DEFAULT_POLICY, DEFAULT_STRATEGY
    from mfsdp_core.strategy import STRATEGY_NAMES

    assert train_args.PRESET_NAMES == tuple(PRESETS)
    assert train_args.DEFAULT_PRESET in PRESETS
    assert train_args.STRATEGY_NAMES == tuple(STRATEGY_NAMES)
    assert train_args.DEFAULT_STRATEGY == DEFAULT_STRATEGY.value
    assert train_args.DEFAULT_POLICY == str(DEFAULT_POLICY)
    assert train_args.TOKEN_DTYPE_NAMES == tuple(sorted(TOKEN_DTYPES))
    assert train_args.CHECKPOINT_FILES == (MANIFEST_NAME, METADATA_NAME)


def _help_entries() -> dict[str, str]:
    """``--flag -> its help text`` (one line) from ``--help``'s option entries."""
    import re

    from cli.train_args import build_parser

    entries: dict[str, str] = {}
    flag = None
    for line in build_parser().format_help().split("options:", 1)[1].splitlines():
        start = re.match(r"^  (-\S+)", line)
        if start:
            flag = start.group(1).rstrip(",")
            entries[flag] = line
        elif flag is not None and line.startswith("   "):
            entries[flag] += " " + line.strip()
        else:
            flag = None
    return {k: " ".join(v.split()) for k, v in entries.items()}


def test_help_shows_every_default() -> None:
    """Each flag with a default says it (0 included: it is not ``False``)."""
    entries = _help_entries()
    for flag, default in [
        ("--seq-len", "64"),
        ("--weight-decay", "0.01"),
        ("--seed", "0"),
        ("--save-every", "0"),
        ("--log-every", "1"),
        ("--keep", "keep all"),
        ("--steps", "100"),
        ("--batch-size", "12"),
    ]:
        assert f"(default: {default})" in entries[flag], (flag, entries[flag])


def test_logging_flags_for_the_other_parts() -> None:
    """``--verbose`` and ``--tensorboard DIR`` parse (their users read ``args.verbose`` and
    ``args.tensorboard``)."""
    from cli.train_args import parse_args

    args = parse_args(["--verbose", "--tensorboard", "tb"])
    assert args.verbose is True and args.tensorboard == "tb"
    args = parse_args([])
    assert args.verbose is False and args.tensorboard is None


# ---- refusals the flags decide: printed by the launcher, before any rank starts --------------


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--model", "tiny-moe", "--ep", "3"], "error: --ep 3: EP size 3 does not divide the world size 2"),
        (
            ["--batch-size", "5"],
            "error: --batch-size 5 must be a multiple of world size x --micro-batches (2 x 1)",
        ),
        (["--resume", "{tmp}/nope"], "error: --resume: {tmp}/nope: no such checkpoint"),
        (["--save-every", "3"], "error: --save-every 3 needs --ckpt-dir (without one the run saves nothing)"),
        (
            ["--resume", "--ckpt-dir", "{tmp}/new"],
            "error: --resume: no checkpoint to resume from (--ckpt-dir {tmp}/new does not exist)",
        ),
        (
            ["--model", "gpt-17"],
            "error: unknown model preset 'gpt-17'; expected one of llama-like-small, mixtral-like-small, "
            "qwen3-like-small, tiny, tiny-deepseek, tiny-moe",
        ),
    ],
    ids=["ep", "batch", "missing-resume", "save-every", "resume-new-dir", "preset"],
)
def test_a_refusal_under_nproc_per_node_is_one_line_before_any_rank(tmp_path, flags, message) -> None:
    """The launching process refuses without importing torch (so no rank was started: a rank is a
    torch process the launcher starts after importing torch's launcher), in one line, and creates
    nothing."""
    argv = [f.format(tmp=tmp_path) for f in flags]
    out = _front_end("--nproc-per-node", "2", *argv)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1, out.stderr
    assert lines == [message.format(tmp=tmp_path), "HEAVY="], out.stderr
    assert os.listdir(tmp_path) == []


def _hf_dir(path) -> str:
    import json

    import torch
    from safetensors.torch import save_file

    os.makedirs(path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"model_type": "llama"}, f)
    save_file({"model.embed_tokens.weight": torch.zeros(4, 4)}, os.path.join(path, "model.safetensors"))
    return str(path)


@pytest.mark.parametrize("flag", ["--init-from", "--resume"])
def test_a_hf_model_dir_given_as_a_checkpoint_points_to_hf_model_and_import_hf(tmp_path, flag) -> None:
    hf = _hf_dir(tmp_path / "hf")
    out = _front_end(flag, hf, "--steps", "1")
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1 and len(lines) == 2, out.stderr
    assert lines[0] == (
        f"error: {flag} {hf}: a Hugging Face model directory (config.json, *.safetensors), not a checkpoint; "
        f"train it with --hf-model {hf}, or make a checkpoint of it with 'mfsdp-ckpt import-hf {hf} OUT'"
    )
    assert "the save did not finish" not in out.stderr


# ---- resuming from a given checkpoint path, with no --ckpt-dir -------------------------------

TINY_RUN = ("--steps", "4", "--batch-size", "4", "--seq-len", "16", "--log-every", "4")
LAYOUTS = {  # flags of the first run; the layout flags (--ep, --dp-replicate) are given again on resume
    "zero3": (["--model", "tiny"], []),
    "ep": (["--model", "tiny-moe", "--ep", "2"], ["--ep", "2"]),
    "muon": (["--model", "tiny", "--optimizer", "muon"], []),
    "hsdp": (["--model", "tiny", "--dp-replicate", "2"], ["--dp-replicate", "2"]),
}


def _launch(*args: str) -> subprocess.CompletedProcess:
    from tests.torchrun import ENV

    cmd = [sys.executable, "-m", "cli.train", "--nproc-per-node", "2", *args]
    return subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)


@pytest.mark.heavy
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_resume_from_a_path_without_ckpt_dir_trains_on_and_saves_nothing(tmp_path, layout) -> None:
    """The run saved step 2 on its way to step 4; a run resumed from ``RUN/step_000002`` alone
    (no --ckpt-dir: the recorded --save-every does not apply) says once that it saves nothing,
    and its steps 3-4 are bitwise the uninterrupted run's."""
    from tests.torchrun import failure, read_metrics

    first, again = LAYOUTS[layout]
    run = tmp_path / "run"
    full = _launch(*first, *TINY_RUN, "--ckpt-dir", str(run), "--save-every", "2", "--metrics", str(tmp_path / "a"))
    assert full.returncode == 0, failure(full)
    before = sorted(os.listdir(run))
    resumed = _launch("--resume", str(run / "step_000002"), *again, "--metrics", str(tmp_path / "b"))
    assert resumed.returncode == 0, failure(resumed)
    assert resumed.stdout.count("checkpoints: none (no --ckpt-dir: this run saves nothing)") == 1, resumed.stdout
    assert "saved" not in resumed.stdout and resumed.stdout.rstrip().endswith("finished: step 4 of 4")
    assert sorted(os.listdir(run)) == before
    a, b = read_metrics(tmp_path / "a"), read_metrics(tmp_path / "b")
    assert sorted(b) == [3, 4] and [b[s]["loss"] for s in (3, 4)] == [a[s]["loss"] for s in (3, 4)]


def test_a_refused_resume_creates_no_ckpt_dir(tmp_path) -> None:
    """Refused after the start checkpoint was read (another --lr than the recorded one), a run with
    a new --ckpt-dir leaves no directory behind (it was created, empty, before the check)."""
    from tests.torchrun import failure, run_train

    first = run_train(None, "--model", "tiny", *TINY_RUN, "--ckpt-dir", str(tmp_path / "run"))
    assert first.returncode == 0, failure(first)
    new = tmp_path / "new"
    refused = run_train(None, "--resume", str(tmp_path / "run" / "step_000004"), "--lr", "1e-2", "--ckpt-dir", str(new))
    assert refused.returncode == 1 and "--allow-change lr" in refused.stderr, failure(refused)
    assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert not new.exists()
    # a recorded value the new world size does not take is named with the manifest that recorded it
    step = tmp_path / "run" / "step_000004"
    out = _front_end("--nproc-per-node", "3", "--resume", str(step))
    assert out.returncode == 1 and out.stderr.splitlines()[0] == (
        f"error: --batch-size 4 (recorded in {step}/mfsdp.json) must be a multiple of world size x "
        "--micro-batches (3 x 1)"
    ), out.stderr


def test_init_from_names_the_model_its_checkpoint_records(tmp_path) -> None:
    """A model of no preset's shape is named in the header of an --init-from run as the run that
    wrote the checkpoint named it (here its --model-config file), not ``custom``."""
    import json

    from mfsdp_core.models.gpt import PRESETS
    from tests.torchrun import failure, run_train

    (tmp_path / "one_layer.json").write_text(json.dumps({**PRESETS["tiny"].to_dict(), "num_layers": 1}))
    small = ("--steps", "1", "--batch-size", "2", "--seq-len", "16")
    first = run_train(
        None, "--model-config", str(tmp_path / "one_layer.json"), *small, "--ckpt-dir", str(tmp_path / "a")
    )
    assert first.returncode == 0, failure(first)
    assert first.stdout.startswith("model one_layer.json, "), first.stdout
    again = run_train(None, "--init-from", str(tmp_path / "a" / "step_000001"), *small)
    assert again.returncode == 0, failure(again)
    header = [line for line in again.stdout.splitlines() if line.startswith("model ")]
    assert header and header[0].startswith("model one_layer.json, "), again.stdout


# ---- a Ctrl-C while a rank imports torch ------------------------------------------------------

_INTERRUPTED_IMPORT = """
import sys

class CtrlCAtTorch:  # the interrupt lands while the rank imports torch, every time
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            raise KeyboardInterrupt

sys.meta_path.insert(0, CtrlCAtTorch())
from cli.train import main
sys.exit(main(["--model", "tiny", "--steps", "1"]))
"""


@pytest.mark.parametrize(
    "env, said",
    [
        ({}, "error: interrupted\n"),  # a lone process: one line
        ({"RANK": "0", "WORLD_SIZE": "2"}, "error: interrupted\n"),  # rank 0 of a plain torchrun job: one line
        ({"RANK": "1", "WORLD_SIZE": "2"}, ""),  # the other ranks: nothing (rank 0 said it)
        ({"RANK": "0", "WORLD_SIZE": "2", "MFSDP_TRAIN_LAUNCHED": "1"}, ""),  # our launcher says it for the job
    ],
    ids=["alone", "torchrun-rank0", "torchrun-rank1", "our-launcher"],
)
def test_ctrl_c_while_importing_torch_is_exit_130_and_at_most_one_line(env, said) -> None:
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MFSDP_TRAIN_LAUNCHED")}
    out = subprocess.run(
        [sys.executable, "-c", _INTERRUPTED_IMPORT],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**base, **env},
    )
    assert out.returncode == 130, out.stderr
    assert out.stderr == said and out.stdout == ""


def test_a_refusal_names_the_file_a_value_came_from(tmp_path) -> None:
    """A refused value the user did not type is named with the file that set it (a resumed
    checkpoint's manifest: tested above); one typed on the command line is not."""
    config = tmp_path / "run.toml"
    config.write_text("save-every = 5\n[training]\nbatch-size = 7\n")
    out = _front_end("--nproc-per-node", "2", "--config", str(config), "--ckpt-dir", str(tmp_path / "c"))
    assert out.stderr.splitlines()[0] == (
        f"error: --batch-size 7 (set in {config}) must be a multiple of world size x --micro-batches (2 x 1)"
    )
    out = _front_end("--nproc-per-node", "2", "--config", str(config), "--save-every", "3", "--batch-size", "8")
    assert out.stderr.splitlines()[0] == "error: --save-every 3 needs --ckpt-dir (without one the run saves nothing)"


# ---- the start checkpoint and the --hf-model directory, checked before any rank starts ---------


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A --ckpt-dir of a finished 1-process run of the tiny preset (steps 1-2, saved at 2)."""
    from tests.torchrun import failure, run_train

    run = tmp_path_factory.mktemp("tiny") / "run"
    out = run_train(
        None, "--model", "tiny", "--steps", "2", "--batch-size", "4", "--seq-len", "16", "--ckpt-dir", str(run)
    )
    assert out.returncode == 0, failure(out)
    return run


def _launched(monkeypatch, capsys, *argv: str) -> tuple[int, list[str], list[list[str]]]:
    """``mfsdp-train --nproc-per-node 2 ARGV`` in this process with the rank launcher replaced by a
    recorder: ``(exit code, stderr lines, the argvs it was asked to launch)``. An empty last item
    means no rank was started."""
    import cli.train

    launches: list[list[str]] = []
    monkeypatch.setattr(cli.train, "launch", lambda args, module, argv: launches.append(argv) or 0)
    capsys.readouterr()
    code = cli.train.main(["--nproc-per-node", "2", *argv])
    return code, capsys.readouterr().err.strip().splitlines(), launches


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--resume", "{step}", "--model", "tiny-moe"],
            "error: --resume: {step} was written for another model config: moe_ffn_hidden_size=0 (this run: 64), "
            "moe_shared_expert_ffn_hidden_size=0 (this run: 64), num_experts=0 (this run: 4)",
        ),
        (
            ["--resume", "{step}", "--lr", "1e-2"],
            "error: --resume: {step} was written with other settings: --lr 0.003 (this run: 0.01); "
            "pass --allow-change lr to resume with this run's values",
        ),
        (  # --ckpt-dir's latest, resolved by the launcher as rank 0 resolves it
            ["--resume", "--ckpt-dir", "{run}", "--strategy", "optim", "--seed", "3"],
            "error: --resume: {step} was written with other settings: --seed 0 (this run: 3); "
            "pass --allow-change seed to resume with this run's values",
        ),
        (
            ["--init-from", "{step}", "--model", "llama-like-small"],
            "error: --init-from: {step} was written for another model config: ",
        ),
    ],
    ids=["model", "settings", "latest", "init-from"],
)
def test_a_refused_start_checkpoint_is_one_line_before_any_rank(monkeypatch, capsys, tiny_run, flags, message):
    """The checkpoint's own checks (written for this model, with this run's settings) are the
    launcher's too: refused in one line, and the ranks are never launched."""
    step = os.path.realpath(tiny_run / "step_000002")
    argv = [f.format(step=step, run=tiny_run) for f in flags]
    code, err, launches = _launched(monkeypatch, capsys, *argv)
    assert (code, launches, len(err)) == (1, [], 1), err
    assert err[0].startswith(message.format(step=step)), err


def test_an_accepted_start_checkpoint_is_launched(monkeypatch, capsys, tiny_run):
    """What the ranks accept the launcher accepts: another --lr allowed by --allow-change, a layout
    flag (not recorded), --resume auto of the latest, the weights of the same model."""
    step = str(tiny_run / "step_000002")
    for argv in (
        ["--resume", step, "--lr", "1e-2", "--allow-change", "lr", "--strategy", "optim"],
        ["--resume", "auto", "--ckpt-dir", str(tiny_run)],
        ["--init-from", step, "--steps", "1", "--batch-size", "2"],
    ):
        code, err, launches = _launched(monkeypatch, capsys, *argv)
        assert (code, err, len(launches)) == (0, [], 1), (argv, err)


def test_a_refused_hf_model_is_one_line_before_any_rank(monkeypatch, capsys, tmp_path):
    """--ep 2 of a transformers model whose experts are fused, and a config transformers cannot
    build, are refused by the launcher, with the ranks' words; a model it accepts is launched."""
    from tests.hf_models import make_hf_dir

    mixtral = make_hf_dir(tmp_path / "mixtral", "mixtral", weights=False)
    code, err, launches = _launched(monkeypatch, capsys, "--hf-model", mixtral, "--ep", "2")
    assert (code, launches, len(err)) == (1, [], 1), err
    assert err[0] == (  # the ranks' text too (mfsdp_ckpt.hf.expert_families.fused_experts_refusal)
        "error: --ep 2: MixtralForCausalLM keeps each MoE layer's experts fused in 3-D parameters "
        "(mlp.experts.gate_up_proj, mlp.experts.down_proj); expert parallelism places whole per-expert "
        "parameters, so train it with --ep 1 (the experts are then sharded over all ranks)"
    ), err
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text('{"model_type": "no-such-model"}')
    code, err, launches = _launched(monkeypatch, capsys, "--hf-model", str(tmp_path / "bad"))
    assert (code, launches, len(err)) == (1, [], 1), err
    assert "model_type 'no-such-model' is not an architecture transformers" in err[0], err
    code, err, launches = _launched(monkeypatch, capsys, "--hf-model", mixtral, "--steps", "1")
    assert (code, err, len(launches)) == (0, [], 1), err


@pytest.mark.parametrize(
    "change, said",
    [
        ({"num_attention_heads": 0}, "num_attention_heads = 0 must be a positive integer"),
        ({"hidden_size": "x"}, 'hidden_size = "x" must be a positive integer'),
        ({"intermediate_size": -8}, "intermediate_size = -8 must be a positive integer"),
    ],
    ids=["zero-heads", "string", "negative"],
)
def test_hostile_hf_config_values_are_one_line_before_any_rank(monkeypatch, capsys, tmp_path, change, said):
    """Values transformers' own checks trip over (a ZeroDivisionError, huggingface_hub's validation
    error, torch's negative dimension) are one line naming the config.json and the field, not a
    traceback: the bridge's own check refuses them before transformers sees them."""
    import json

    from tests.hf_models import make_hf_dir

    src = make_hf_dir(tmp_path / "m", "mixtral", weights=False)
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, **change}))
    code, err, launches = _launched(monkeypatch, capsys, "--hf-model", src)
    assert (code, launches, len(err)) == (1, [], 1), err
    assert err[0].startswith(f"error: {src}/config.json: {said}"), err
