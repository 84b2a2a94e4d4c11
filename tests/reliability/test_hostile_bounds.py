"""Sizes, counts and ranks from a file are checked against what the checkpoint itself holds before
anything is allocated or built (issue 52, causes 1 and 5), and a writer never commits what its
readers refuse.

The index's ``mesh.world`` must be the number of ranks whose data files the index lists (every
rank of a save writes one); every rank named (a file's, a group member, a key written whole, an
EP rank) must be one of them; each record table must fit in its file; the writer's group sizes
must fit in the world. A hostile manifest (checksum re-stamped, as an attacker would) is refused
by every reader with one line naming ``mfsdp.json`` and the field, exit 1, nothing written, no
input changed, and the readers run under an address-space cap (``RLIMIT_AS``), so that a reader
allocating what a size asks for fails the case instead of swapping: ``world = 2**28`` used to
end in MemoryError, an EP rank without an EP group in ``KeyError: 'ep'``.

``upcycle --num-experts`` is bounded before its plan is built; ``convert --to dcp`` refuses a key
its readers would refuse before writing, and every writer checks its manifest against the
readers' schema before it commits."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from collections import namedtuple
from typing import Any, Callable

import pytest
import torch
from click.testing import CliRunner

from cli.main import main
from mfsdp_ckpt import CheckpointError
from mfsdp_ckpt.tools.convert import write_dcp
from mfsdp_ckpt.tools.upcycle import MAX_EXPERTS
from mfsdp_core.models.gpt import PRESETS, GPTModel
from tests.reliability.test_hostile_support import edit_manifest, read_json, run_capped, save_small, trained_mlp

pytestmark = pytest.mark.timeout(300)

# What the capped process needs to read a clean checkpoint with every reader (import torch maps
# most of it): measured 704 MiB (a plain `mfsdp-ckpt verify`: 680 MiB); the cap is that + ~1.3 GiB,
# far below what a hostile size asks for (world = 2**28: about 10 GiB of Python ints).
# Each run reads the clean checkpoint first, under the same cap, and must succeed: the control.
CAP = 2 << 30
FUZZ_CASES = 24
SEED = 52

Case = namedtuple("Case", "name base edit field")


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, str]:
    """Two clean checkpoints of the test MLP: ``indexed`` (as ``save`` writes it) and ``listed``
    (every chunk listed, no index: the offline tools' form)."""
    root = str(tmp_path_factory.mktemp("bounds"))
    model, optim = trained_mlp()
    return {
        "indexed": save_small(os.path.join(root, "indexed", "step_1"), 1, model, optim, listed=False),
        "listed": save_small(os.path.join(root, "listed", "step_1"), 1, model, optim, listed=True),
    }


def _set(*path: Any, value: Any) -> Callable[[dict], None]:
    def edit(m: dict) -> None:
        node = m
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = value

    return edit


def _first_whole_key(m: dict) -> str:
    return next(k for k, v in sorted(m["index"]["keys"].items()) if type(v[2]) is int)


def _set_whole_key_rank(value: Any) -> Callable[[dict], None]:
    def edit(m: dict) -> None:
        m["index"]["keys"][_first_whole_key(m)][2] = value

    return edit


_B0 = ("writer", "plan", "buffers", 0)
NAMED = [
    # the examples, and one of each other size or rank taken on trust
    Case("world 2**28", "indexed", _set("index", "mesh", "world", value=2**28), "index.mesh.world"),
    Case("world 2 for 1 rank's files", "indexed", _set("index", "mesh", "world", value=2), "index.mesh.world"),
    Case("EP rank without an EP group", "indexed", _set("index", "ep_ranks", 0, value=0), "index.ep_ranks[0]"),
    Case("EP rank 5", "indexed", _set("index", "ep_ranks", 1, value=5), "index.ep_ranks[1]"),
    Case("file of rank 3", "indexed", _set("index", "files", 0, 1, value=3), "index.files[0][1]"),
    Case("record table over the file", "indexed", _set("index", "files", 0, 3, value=2**40), "index.files[0][3]"),
    Case("group member 2**28", "indexed", _set("index", "mesh", "groups", "dp", value=[[2**28]]), "index.mesh.groups"),
    Case("plan group size 2**40", "indexed", _set(*_B0, "group_size", value=2**40), "writer.plan.buffers[0]"),
    Case(
        "plan group_sizes 2**40",
        "indexed",
        _set("writer", "plan", "group_sizes", "dp", value=2**40),
        "writer.plan.group_sizes",
    ),
    Case("writer world size 2**40", "indexed", _set("writer", "world_size", value=2**40), "writer.world_size"),
    Case("listed: world size 2**40", "listed", _set("writer", "world_size", value=2**40), "writer.world_size"),
    Case("listed: group size 2**40", "listed", _set(*_B0, "group_size", value=2**40), "writer.plan.buffers[0]"),
]

# the fuzzer's fields: (path or edit maker, the field the error names, values all wrong there;
# the clean index has world 1, one data file of rank 0, no EP group, group sizes 1)
_NOT_INTS = ["1", 1.5, True, None, [], {}]
FIELDS: list[tuple[Callable[[Any], Callable[[dict], None]], str, list[Any]]] = [
    (lambda v: _set("index", "mesh", "world", value=v), "index.mesh.world", [0, -1, 2, 2**28, 2**62, *_NOT_INTS]),
    (lambda v: _set("index", "ep_ranks", 0, value=v), "index.ep_ranks[0]", [0, 1, 5, 2**40, -1, "0", 1.5, True]),
    (lambda v: _set("index", "files", 0, 1, value=v), "index.files[0][1]", [1, 3, 2**40, -1, *_NOT_INTS]),
    (lambda v: _set("index", "files", 0, 3, value=v), "index.files[0][3]", [4000, 2**40, 2**62, -1, *_NOT_INTS]),
    (lambda v: _set("index", "files", 0, 2, value=v), "index.files[0][", [0, 19, -1, "x", None]),
    (lambda v: _set("index", "mesh", "groups", "dp", 0, 0, value=v), "index.mesh.groups", [1, 2**28, -1, "0"]),
    (_set_whole_key_rank, "index.keys[", [1, 2**40, -1, 1.5]),
    (lambda v: _set(*_B0, "group_size", value=v), "writer.plan.buffers[0].group_size", [2, 2**40, 0, -1, "1"]),
    (lambda v: _set("writer", "plan", "group_sizes", "dp", value=v), "writer.plan.group_sizes", [2, 2**40, 0, None]),
    (lambda v: _set("writer", "world_size", value=v), "writer.world_size", [2, 2**40, 0, "1"]),
]


def _fuzz_cases() -> list[Case]:
    rng = random.Random(SEED)
    out = []
    for n in range(FUZZ_CASES):
        make, field, values = FIELDS[n % len(FIELDS)] if n < len(FIELDS) else rng.choice(FIELDS)
        value = rng.choice(values)
        out.append(Case(f"fuzz {n}: {field} = {value!r}"[:80], "indexed", make(value), field))
    return out


def _snapshot(root: str) -> dict[str, tuple[int, str]]:
    """Every path under ``root`` with its size and digest (links and folders by name)."""
    out = {}
    for d, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(d, name)
            rel = os.path.relpath(path, root)
            if os.path.islink(path) or os.path.isdir(path):
                out[rel] = (0, "link" if os.path.islink(path) else "dir")
            else:
                with open(path, "rb") as f:
                    out[rel] = (os.path.getsize(path), hashlib.sha1(f.read()).hexdigest())
    return out


def _capped(jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Run ``jobs`` (tests/reliability/bounds_readers.py) in one process under :data:`CAP`."""

    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    out = run_capped(["-m", "tests.reliability.bounds_readers"], CAP, input=json.dumps(jobs), env=env, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    results = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert len(results) == len(jobs), out.stdout[-3000:]
    return results


def _reading_jobs(ckpt: str, clean: str, dst: str) -> list[dict[str, Any]]:
    """Every reader of ``ckpt``: the CLI's verify, inspect, diff and reshard (to ``dst``), and load."""
    return [
        {"argv": ["verify", ckpt]},
        {"argv": ["inspect", ckpt]},
        {"argv": ["diff", ckpt, clean]},
        {"argv": ["reshard", ckpt, dst, "--world-size", "2"]},
        {"load": ckpt},
    ]


@pytest.fixture(scope="module")
def capped_run(bases, dense, tmp_path_factory) -> dict[str, Any]:
    """Every capped job of this module in one process (one start-up of torch): the control (the
    clean bases, read by every reader: they must succeed under the cap), then each case of
    :data:`NAMED` and of the fuzzer (a copy of its base, its manifest edited and resealed, read by
    every reader), then ``upcycle --num-experts 2**31``. Snapshots of every input and of the
    cases' folders before and after."""
    root = str(tmp_path_factory.mktemp("capped"))
    groups: dict[str, list[dict[str, Any]]] = {"control": []}
    for base in sorted(bases):
        groups["control"] += _reading_jobs(bases[base], bases["indexed"], os.path.join(root, "control", base))
    for kind, cases in (("named", NAMED), ("fuzz", _fuzz_cases())):
        groups[kind] = []
        for n, case in enumerate(cases):
            ckpt = shutil.copytree(bases[case.base], os.path.join(root, "cases", kind, str(n), "step_1"))
            edit_manifest(ckpt, case.edit)
            groups[kind] += [
                dict(job, case=case.name, ckpt=ckpt, field=case.field)
                for job in _reading_jobs(ckpt, bases["indexed"], os.path.join(root, "cases", kind, str(n), "out"))
            ]
    upcycled = os.path.join(root, "cases", "upcycle", "moe")
    os.makedirs(os.path.dirname(upcycled))
    groups["upcycle"] = [{"argv": ["upcycle", dense, upcycled, "--num-experts", str(2**31), "--topk", "2"]}]
    watched = [os.path.join(root, "cases"), *map(os.path.dirname, bases.values()), dense]
    before = {w: _snapshot(w) for w in watched}
    jobs = [job for name in groups for job in groups[name]]
    results = _capped([{k: v for k, v in job.items() if k in ("argv", "load")} for job in jobs])
    after = {w: _snapshot(w) for w in watched}
    out, at = {"before": before, "after": after}, 0
    for name, group in groups.items():
        out[name] = list(zip(group, results[at : at + len(group)]))
        at += len(group)
    return out


def _refused_by_every_reader(run: dict[str, Any], kind: str) -> None:
    """The control read clean; each case of ``kind``: one line naming ``mfsdp.json`` and the field,
    exit 1, from every reader; nothing written and no input changed."""
    assert all(r["exit"] == 0 for _, r in run["control"]), run["control"]
    problems = []
    for job, r in run[kind]:
        lines = r["stderr"].strip().splitlines()
        named = len(lines) == 1 and f"{job['ckpt']}/mfsdp.json" in lines[0] and f"field '{job['field']}" in lines[0]
        if r["exit"] != 1 or not named:
            what = job.get("argv", ["load"])[0]
            problems.append(f"{job['case']} / {what}: exit {r['exit']}: {r['stderr'].strip()[-300:]}")
    assert not problems, "\n".join(problems)
    assert run["after"] == run["before"]


def test_hostile_sizes_in_the_index_are_one_line_from_every_reader_under_a_cap(capped_run):
    """The issue's examples (``world = 2**28``: MemoryError; an EP rank the mesh lacks:
    ``KeyError 'ep'``) and one of each other size or rank taken on trust."""
    _refused_by_every_reader(capped_run, "named")


def test_hostile_index_fuzz_under_a_cap(capped_run):
    """Seeded: every field of the index a size or rank comes from, each with a value wrong there
    (huge, zero, negative, not an integer, a rank the job lacks)."""
    _refused_by_every_reader(capped_run, "fuzz")


# ---- upcycle --num-experts ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> str:
    """A dense checkpoint of the tiny reference GPT (what upcycle takes)."""
    from mfsdp_ckpt.write.builder import CheckpointBuilder

    config = PRESETS["tiny"]
    torch.manual_seed(0)
    path = str(tmp_path_factory.mktemp("dense") / "dense")
    manifest = {"writer": {"world_size": 1, "buffers": [], "groups": []}, "model_config": config.to_dict()}
    with CheckpointBuilder(path, manifest) as b:
        for k, v in GPTModel(config).named_parameters():
            b.add_tensor(f"model.{k}", v.detach())
        b.commit()
    return path


def _one_line_refusal(result, *words: str) -> None:
    assert result.exit_code == 1, (result.exit_code, result.output, result.exception)
    assert result.stderr.count("\n") == 1, result.stderr
    assert all(w in result.stderr for w in words), result.stderr


def test_upcycle_bounds_num_experts_before_building_its_plan(capped_run, dense):
    """``--num-experts 2**31`` built its plan (a key per expert) until MemoryError; refused first
    now (in the capped process, so that the old behaviour fails the test instead of swapping)."""
    ((job, r),) = capped_run["upcycle"]
    assert r["exit"] == 1 and r["stderr"].count("\n") == 1, r
    assert f"--num-experts {2**31}: must be at most {MAX_EXPERTS}" in r["stderr"], r
    assert not os.path.lexists(job["argv"][2]) and os.listdir(os.path.dirname(job["argv"][2])) == []
    assert capped_run["after"] == capped_run["before"]


def test_upcycle_refuses_a_result_larger_than_the_free_space(dense, tmp_path, monkeypatch):
    """Within the cap, the bytes the upcycled checkpoint needs are compared with the free space
    where it goes, before anything is built or written."""
    free = shutil.disk_usage(str(tmp_path))._replace(free=100_000)
    monkeypatch.setattr("mfsdp_ckpt.write.destination.shutil.disk_usage", lambda _: free)
    dst = str(tmp_path / "moe")
    result = CliRunner().invoke(main, ["upcycle", dense, dst, "--num-experts", "64", "--topk", "2"])
    _one_line_refusal(result, dense, "--num-experts 64", "GiB free")
    assert os.listdir(tmp_path) == []


# ---- a writer never commits what its readers refuse -------------------------------------------------


def test_convert_to_dcp_refuses_a_key_its_readers_refuse_before_writing(tmp_path):
    """``convert --to dcp`` committed keys with control characters, which every reader then
    refused: the key is refused now, named, before anything is written."""
    src = str(tmp_path / "in" / "state.pt")
    os.makedirs(os.path.dirname(src))
    torch.save({"model.ok": torch.zeros(2), "model.a\nb": torch.ones(3)}, src)
    before = _snapshot(str(tmp_path / "in"))
    result = CliRunner().invoke(main, ["convert", src, str(tmp_path / "out" / "ckpt"), "--to", "dcp"])
    _one_line_refusal(result, src, "key 'model.a\\nb'", "holds control characters")
    assert not os.path.exists(tmp_path / "out") or os.listdir(tmp_path / "out") == []
    assert _snapshot(str(tmp_path / "in")) == before


def test_a_writer_never_commits_a_manifest_its_readers_refuse(tmp_path):
    """Below every writer's own checks, the commit itself runs the readers' schema on the manifest
    it is about to write: the Python API's ``write_dcp`` (which checks no key) commits nothing."""
    os.makedirs(tmp_path / "out")
    with pytest.raises(CheckpointError, match=r"\(not committed\): field 'chunks key .*holds control characters"):
        write_dcp({"model.a\x07b": torch.ones(2)}, str(tmp_path / "out" / "ckpt"))
    assert os.listdir(tmp_path / "out") == []


def test_the_clean_bases_satisfy_the_bounds(bases):
    """What a save writes is within the bounds: world = the ranks of its data files."""
    m = read_json(bases["indexed"])
    assert m["index"]["mesh"]["world"] == len({f[1] for f in m["index"]["files"]}) == m["writer"]["world_size"]
