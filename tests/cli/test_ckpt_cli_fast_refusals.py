"""``mfsdp-ckpt`` answers ``--help`` and refuses what its arguments and local paths alone decide (a
missing input, an existing destination without ``--overwrite``, a bad flag value) before it
imports torch: in a tenth of a second instead of two or more. Each case runs the program in a
fresh interpreter under ``-X importtime`` and checks that neither torch nor numpy, safetensors,
transformers or an object store's libraries were imported, and that the refusal is the one line
and exit code the command gave when it imported everything first (recorded from that code).

``ls --mem-tier`` of a directory that does not exist, or of an object store, is refused in one
line too (it used to list "0 snapshot(s)" of the missing directory, and to try S3 credentials)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from cli.main import main

ROOT = Path(__file__).resolve().parent.parent.parent
DENSE = ROOT / "fixtures" / "mcore" / "dense"
HEAVY = ("torch", "numpy", "safetensors", "transformers", "fsspec", "s3fs", "botocore", "aiobotocore")
KEY_MAP = "expected OLD=NEW (a prefix rename: '=model.' adds 'model.', 'model.=' strips it)"
SIZE = "expected e.g. 5GB, 500MB, 2GiB or a number of bytes"
ARCHS = "deepseek_v3, llama, mixtral, qwen2, qwen3, qwen3_moe, qwen3_next"
EXISTS = "already exists (use --overwrite / overwrite=True to replace it)"

#: (arguments, exit code, the last line on stderr); {m}: a missing path, {x}: an existing
#: checkpoint directory, {o}: a new path, {c}: a checkpoint, {h}: an HF directory, {mc}: an MCore one
REFUSALS = [
    (["inspect", "{m}"], 1, "error: {m}: no such checkpoint"),
    (["inspect", "{m}", "--json"], 1, '{{"error": "{m}: no such checkpoint", "kind": "NotACheckpointError"}}'),
    (["verify", "{m}"], 1, "error: {m}: no such checkpoint"),
    (["verify", "{m}", "--json"], 1, '{{"error": "{m}: no such checkpoint", "kind": "NotACheckpointError"}}'),
    (["diff", "{m}", "{c}"], 1, "error: {m}: no such checkpoint"),
    (["diff", "{c}", "{m}"], 1, "error: {m}: no such checkpoint"),
    (["diff", "{c}", "{m}", "--key-map-a", "bad"], 1, f"error: --key-map 'bad': {KEY_MAP}"),
    (["diff", "{c}", "{c}", "--atol", "abc"], 2, "Error: Invalid value for '--atol': 'abc' is not a valid float."),
    (["convert", "{m}", "{o}", "--to", "torch"], 1, "error: {m}: no such checkpoint"),
    (["convert", "{m}", "{o}", "--to", "dcp-fsdp2"], 1, "error: {m}: no such checkpoint"),
    (
        ["convert", "{m}", "{o}", "--to", "dcp"],
        1,
        "error: {m}: not a file (convert --to dcp reads a .pt or .safetensors file)",
    ),
    (["convert", "{c}", "{x}", "--to", "dcp-fsdp2"], 1, "error: {x}: already exists"),
    (["convert", "{m}", "{x}", "--to", "safetensors"], 1, "error: {x}: already exists"),
    (["convert", "{c}", "{o}", "--to", "dcp-fsdp2", "--key-map", "bad"], 1, f"error: --key-map 'bad': {KEY_MAP}"),
    (
        ["convert", "{c}", "{o}", "--to", "torch", "--key-map", "a=b"],
        1,
        "error: --key-map: applies to --to dcp-fsdp2 only, not --to torch",
    ),
    (
        ["convert", "{c}", "{o}", "--to", "dcp-fsdp2", "--max-file-size", "bogus"],
        1,
        f"error: --max-file-size: 'bogus': {SIZE}",
    ),
    (
        ["convert", "{c}", "{c}/sub", "--to", "dcp-fsdp2"],
        1,
        "error: {c}/sub: lies inside the source {c}; write it elsewhere",
    ),
    (["reshard", "{m}", "{o}", "--world-size", "2"], 1, "error: {m}: no such checkpoint"),
    (
        ["reshard", "{m}", "{o}", "--world-size", "2", "--json"],
        1,
        '{{"error": "{m}: no such checkpoint", "kind": "NotACheckpointError"}}',
    ),
    (["reshard", "{c}", "{x}", "--world-size", "2"], 1, f"error: {{x}}: {EXISTS}"),
    (["reshard", "{c}", "{o}", "--world-size", "0"], 1, "error: --world-size must be >= 1, got 0"),
    (["reshard", "{c}", "{o}", "--world-size", "100000"], 1, "error: --world-size must be <= 65536, got 100000"),
    (["reshard", "{c}", "{o}", "--world-size", "2", "--workers", "0"], 1, "error: --workers must be >= 1, got 0"),
    (
        ["reshard", "{c}", "{o}", "--world-size", "2", "--strategy", "bogus"],
        1,
        "error: --strategy: unknown sharding strategy 'bogus'; expected one of no_shard, optim, optim_grads, "
        "optim_grads_params",
    ),
    (
        ["reshard", "{c}", "{o}", "--world-size", "2", "--policy", "bogus"],
        1,
        "error: --policy: unknown sharding policy 'bogus'; expected one of even, row, block(n), tensor",
    ),
    (
        ["reshard", "{c}", "{o}", "--world-size", "2", "--dtype", "bogus"],
        2,
        "Error: Invalid value for '--dtype': 'bogus' is not one of 'float32', 'bfloat16', 'float16'.",
    ),
    (["reshard", "{c}", "{o}", "--world-size", "2", "--key-map", "bad"], 1, f"error: --key-map 'bad': {KEY_MAP}"),
    (["reshard", "{c}", "{o}", "--world-size", "2", "--ep", "0"], 1, "error: --ep must be >= 1, got 0"),
    (["reshard", "{c}", "{o}", "--world-size", "2", "--plan-from", "{m}"], 1, "error: {m}: no such checkpoint"),
    (["reshard", "{m}", "{x}", "--world-size", "0"], 1, "error: --world-size must be >= 1, got 0"),
    (["upcycle", "{m}", "{o}", "--num-experts", "2", "--topk", "1"], 1, "error: {m}: no such checkpoint"),
    (["upcycle", "{c}", "{x}", "--num-experts", "2", "--topk", "1"], 1, f"error: {{x}}: {EXISTS}"),
    (
        ["upcycle", "{c}", "{o}", "--num-experts", "0", "--topk", "1"],
        1,
        "error: {c}: --num-experts 0: must be at least 1",
    ),
    (
        ["upcycle", "{c}", "{o}", "--num-experts", "2", "--topk", "3"],
        1,
        "error: {c}: --topk 3: must be in [1, --num-experts 2]",
    ),
    (
        ["upcycle", "{c}", "{o}", "--num-experts", "2", "--topk", "1", "--granularity", "0"],
        1,
        "error: {c}: --granularity 0: must be at least 1",
    ),
    (["ls", "{m}"], 1, "error: {m}: no such directory"),
    (["ls", "{m}", "--json"], 1, '{{"error": "{m}: no such directory", "kind": "NotACheckpointError"}}'),
    (["ls", "{m}", "--clean"], 1, "error: {m}: no such directory"),
    (["export-hf", "{m}", "{o}"], 1, "error: {m}: no such checkpoint"),
    (["export-hf", "{m}", "{o}", "--adapter"], 1, "error: {m}: no such checkpoint"),
    (["export-hf", "{c}", "{x}"], 1, f"error: {{x}}: {EXISTS}"),
    (["export-hf", "{c}", "{o}", "--max-shard-size", "bogus"], 1, f"error: max shard size 'bogus': {SIZE}"),
    (["export-hf", "{c}", "{o}", "--arch", "bogus"], 1, f"error: unknown architecture 'bogus'; known: {ARCHS}"),
    (
        ["export-hf", "{c}", "{o}", "--dtype", "bogus"],
        2,
        "Error: Invalid value for '--dtype': 'bogus' is not one of 'float32', 'bfloat16', 'float16'.",
    ),
    (["export-hf", "{c}", "{o}", "--from-mx", "--mx"], 2, "Error: --from-mx and --mx exclude each other"),
    (
        ["export-hf", "{mc}", "{o}", "--mcore-config", "{m}"],
        1,
        "error: {m}: cannot read config (No such file or directory)",
    ),
    (["import-hf", "{m}", "{o}"], 1, "error: {m}: not a directory"),
    (["import-hf", "{h}", "{x}"], 1, f"error: {{x}}: {EXISTS}"),
    (["import-hf", "{h}", "{o}", "--max-file-size", "bogus"], 1, f"error: --max-file-size: 'bogus': {SIZE}"),
    (["import-hf", "{h}", "{o}", "--arch", "bogus"], 1, f"error: unknown architecture 'bogus'; known: {ARCHS}"),
    (["import-mcore", "{m}", "{o}"], 1, "error: {m}: no such checkpoint"),
    (["import-mcore", "{mc}", "{x}", "--config", "{mc}.config.json"], 1, f"error: {{x}}: {EXISTS}"),
    (
        ["import-mcore", "{mc}", "{o}", "--config", "{m}"],
        1,
        "error: {m}: cannot read config (No such file or directory)",
    ),
    (["export-mcore", "{m}", "{o}"], 1, "error: {m}: no such checkpoint"),
    (["export-mcore", "{c}", "{x}"], 1, f"error: {{x}}: {EXISTS}"),
    (["export-mcore", "{c}", "{o}", "--max-file-size", "bogus"], 1, f"error: --max-file-size: 'bogus': {SIZE}"),
]


def _invoke(*args: str) -> None:
    result = CliRunner().invoke(main, list(args))
    assert result.exit_code == 0, (args, result.output, result.exception)


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A checkpoint (imported from the Megatron-Core fixture), its HF export, the fixture itself, an
    existing checkpoint to be refused as a destination, and a missing path."""
    tmp = tmp_path_factory.mktemp("refusals")
    out = {"c": str(tmp / "ckpt"), "h": str(tmp / "hf"), "x": str(tmp / "exists"), "mc": str(DENSE)}
    _invoke("import-mcore", str(DENSE), out["c"], "--config", f"{DENSE}.config.json")
    _invoke("export-hf", out["c"], out["h"])
    _invoke("reshard", out["c"], out["x"], "--world-size", "1")
    return {**out, "m": str(tmp / "missing"), "o": str(tmp / "new" / "out")}


def _program(*args: str) -> tuple[int, list[str], set[str]]:
    """``mfsdp-ckpt args`` in a fresh interpreter: its exit code, its stderr lines (less
    ``-X importtime``'s) and the heavy modules it imported."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHONWARNINGS", "AWS_"))}
    env.update(COLUMNS="200", FSSPEC_S3_ENDPOINT_URL="http://127.0.0.1:9")  # no real S3 is ever asked
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "cli.main", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = out.stderr.splitlines()
    imported = {line.rsplit("|", 1)[1].strip() for line in lines if line.startswith("import time:")}
    heavy = {m for m in imported if m.split(".")[0] in HEAVY}
    return out.returncode, [line for line in lines if not line.startswith("import time:")], heavy


def test_help_of_every_command_imports_no_torch() -> None:
    commands = [[], *([name] for name in sorted(main.commands))]
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda c: (c, _program(*c, "--help")), commands))
    for command, (code, stderr, heavy) in results:
        assert (code, stderr, heavy) == (0, [], set()), command


@pytest.mark.parametrize(("args", "code", "line"), REFUSALS, ids=[" ".join(a[:1] + a[3:]) for a, _, _ in REFUSALS])
def test_a_refusal_comes_before_torch_in_the_same_words(
    paths: dict[str, str], args: list[str], code: int, line: str
) -> None:
    got_code, stderr, heavy = _program(*(a.format(**paths) for a in args))
    assert (got_code, stderr[-1:]) == (code, [line.format(**paths)]), stderr
    assert heavy == set(), f"imported before refusing: {sorted(heavy)}"
    assert not os.path.exists(paths["o"]) and not os.path.exists(os.path.dirname(paths["o"]))


def test_ls_refuses_a_memory_tier_that_is_no_local_directory(paths: dict[str, str], tmp_path: Path) -> None:
    run = os.path.dirname(paths["c"])
    code, stderr, heavy = _program("ls", run, "--mem-tier", paths["m"])
    assert (code, stderr, heavy) == (1, [f"error: --mem-tier {paths['m']}: no such directory"], set())
    code, stderr, heavy = _program("ls", run, "--mem-tier", paths["c"] + "/mfsdp.json")
    assert (code, stderr) == (1, [f"error: --mem-tier {paths['c']}/mfsdp.json: not a directory"])
    code, stderr, heavy = _program("ls", run, "--mem-tier", "s3://bucket/tier", "--json")
    message = "--mem-tier s3://bucket/tier: must be a local directory (a tmpfs such as /dev/shm/...)"
    assert (code, [json.loads(e) for e in stderr], heavy) == (1, [{"error": message, "kind": "CheckpointError"}], set())
    empty = tmp_path / "tier"
    empty.mkdir()  # a directory that holds no snapshot of the run: listed as such
    listed = subprocess.run(
        [sys.executable, "-m", "cli.main", "ls", run, "--mem-tier", str(empty)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert listed.returncode == 0 and f"memory tier {empty}: 0 snapshot(s)" in listed.stdout, listed


def test_what_the_refusals_copy_from_modules_that_import_torch_agrees() -> None:
    """The bounds, choices, size parser and architecture names the command line checks without
    torch are those of the library's modules (which import it)."""
    from cli import common
    from cli import main as cli_main
    from mfsdp_ckpt.hf.config import MAX_COUNT
    from mfsdp_ckpt.hf.files import parse_size
    from mfsdp_ckpt.hf.registry import architectures
    from mfsdp_ckpt.hf.workers import max_file_bytes
    from mfsdp_ckpt.read.stock import parse_key_map
    from mfsdp_ckpt.sharded.reshard import MAX_WORLD_SIZE
    from mfsdp_ckpt.tools.upcycle import MAX_EXPERTS
    from mfsdp_core.dtypes import CAST_CHOICES

    assert cli_main.MAX_WORLD_SIZE == MAX_WORLD_SIZE and MAX_EXPERTS == MAX_COUNT
    assert common.CAST_CHOICES == CAST_CHOICES
    assert common.arch_names() == sorted(architectures())
    for rule in ["=model.", "model.=", "a=b=c", "=", "bad", "", "model."]:
        assert _refusal(common.check_key_map, [rule]) == _refusal(parse_key_map, [rule]), rule
    for text in ["5GB", "500MB", "2GiB", "123", " 7 kib ", "1.5gb", "0", "0.1B", "bogus", "-1", "", "5 GB", "1e3"]:
        for flag, parse in (("--max-shard-size", parse_size), ("--max-file-size", max_file_bytes)):
            assert _refusal(common.check_size, text, flag) == _refusal(parse, text), (flag, text)


def _refusal(check: Any, *args: Any) -> tuple[str, str] | None:
    """The class and message of what ``check(*args)`` raises (None: nothing)."""
    from mfsdp_ckpt.errors import CheckpointError

    try:
        check(*args)
    except CheckpointError as e:
        return type(e).__name__, str(e)
    return None
