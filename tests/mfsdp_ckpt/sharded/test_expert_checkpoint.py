"""Checkpoints of expert-parallel models: experts are stored under their global names, so a
checkpoint saved at (world size W, EP size E) loads at any other (W', E') bitwise, online and
after an offline ``reshard --ep``; a resumed run continues bitwise; bad input is refused in one
line and changes nothing; ``inspect`` shows which EP rank held which experts.

A small MoE GPT with 12 experts (divisible by 1, 2, 3 and 4) is trained 3 AdamW steps at
(4, 4), so every expert and its optimizer state (exp_avg, exp_avg_sq, step) is distinct."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from click.testing import CliRunner

import mfsdp_ckpt
from cli.main import main
from mfsdp_ckpt.read.reader import CheckpointReader
from mfsdp_ckpt.tools.diff import diff_checkpoints
from mfsdp_ckpt.tools.inspect import inspect_checkpoint, verify_checkpoint
from mfsdp_ckpt.write.builder import CheckpointBuilder
from mfsdp_core import ModelPlan, describe_shards, fully_shard, fully_shard_optimizer
from mfsdp_core.expert_parallel import expert_placement, init_expert_mesh
from mfsdp_core.models.gpt import GPTModel, get_preset, shard_experts, shard_units
from tests.harness import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
CFG = dataclasses.replace(
    get_preset("tiny-moe"), num_experts=12, moe_ffn_hidden_size=32, moe_shared_expert_ffn_hidden_size=32, seq_length=16
)
FC1 = "decoder.layers.0.mlp.experts.linear_fc1.weight"
STEPS = 3  # trained before the save
MORE = 2  # trained after it (resume)


# ---- helpers run on every rank ----------------------------------------------------------------


def build(ep: int, seed: int = 0, config=CFG, strategy: str = "optim_grads_params", policy: str = "even"):
    """The MoE GPT at EP size ``ep`` over the current world (no process group: one rank), with
    its adapted AdamW."""
    mesh = init_expert_mesh(ep, config.num_experts)
    torch.manual_seed(seed)
    model = shard_experts(GPTModel(config), mesh)
    for unit in shard_units(model):
        fully_shard(unit, mesh=mesh.groups, placement=expert_placement(policy), strategy=strategy)
    return model, fully_shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))


def train(model, optim, start: int, stop: int) -> list[float]:
    """Steps ``start`` .. ``stop - 1``; rank r trains on its own 2 sequences of each step (the
    same at every EP size for a given world size). Returns the losses."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    losses = []
    for step in range(start, stop):
        gen = torch.Generator().manual_seed(1000 * step + rank)
        tokens = torch.randint(0, CFG.vocab_size, (2, 9), generator=gen)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)) + model.aux_loss
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def pieces(model, optim) -> dict[str, tuple]:
    """Canonical key -> (shape, start, end, values) of the range this rank owns: weights, main
    params, per-element optimizer state; scalar optimizer state (AdamW's step) as (None, 0, 0,
    value)."""
    out = {}
    for ps in describe_shards(model, optim):
        lo, hi = ps.owned
        out[f"model.{ps.fqn}"] = (ps.shape, lo, hi, ps.param.tensor[lo - ps.param.start : hi - ps.param.start].clone())
        out[f"main.{ps.fqn}"] = (ps.shape, lo, hi, ps.main.tensor.clone())
        for name, fs in ps.optim.items():
            out[f"optim.{ps.fqn}.{name}"] = (ps.shape, lo, hi, fs.tensor.clone())
        for name, value in ps.optim_extra.items():
            out[f"optim.{ps.fqn}.{name}"] = (None, 0, 0, value.clone() if isinstance(value, torch.Tensor) else value)
    return out


def state_of(model, optim) -> dict[str, torch.Tensor]:
    """Everything this rank holds, to check that a failed load changed nothing."""
    out = {f"{k}": v[3] for k, v in pieces(model, optim).items()}
    out.update(
        {
            f"group{g}.{k}": torch.tensor(float(v))
            for g, group in enumerate(optim.param_groups)
            for k, v in group.items()
            if isinstance(v, (int, float))
        }
    )
    return out


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


# ---- in the test process ----------------------------------------------------------------------


def assemble(per_rank: list[dict]) -> dict[str, torch.Tensor]:
    """Full logical tensors from every rank's owned pieces; each element covered exactly once;
    scalar state equal on every rank that holds it."""
    full: dict[str, torch.Tensor] = {}
    keys = sorted({k for p in per_rank for k in p})
    for key in keys:
        held = [p[key] for p in per_rank if key in p]
        shape = held[0][0]
        if shape is None:
            values = [h[3] for h in held]
            assert all(torch.equal(v, values[0]) for v in values), key
            full[key] = values[0]
            continue
        flat = torch.full((shape.numel(),), float("nan"), dtype=held[0][3].dtype)
        seen = torch.zeros(shape.numel(), dtype=torch.int32)
        for _, lo, hi, values in held:
            flat[lo:hi] = values
            seen[lo:hi] += 1
        assert bool((seen == 1).all()), f"{key}: elements covered {seen.min().item()}..{seen.max().item()} times"
        full[key] = flat.view(shape)
    return full


def assert_same(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor], what: str) -> None:
    assert sorted(got) == sorted(expected), f"{what}: keys differ: {sorted(set(got) ^ set(expected))[:6]}"
    differ = [k for k in expected if expected[k].dtype != got[k].dtype or not torch.equal(expected[k], got[k])]
    assert not differ, f"{what}: {len(differ)} entries differ, e.g. {differ[:4]}"


# ---- the source checkpoint: (4, 4), 3 steps ----------------------------------------------------


def _train_and_save(root: str) -> dict:
    """At (4, 4): 3 steps, save, then 2 more steps without interruption (the resume reference)."""
    model, optim = build(4)
    train(model, optim, 0, STEPS)
    mfsdp_ckpt.save(os.path.join(root, "src"), model, optim, extra={"step": STEPS}, step=STEPS)
    saved = pieces(model, optim)
    losses = train(model, optim, STEPS, STEPS + MORE)
    return {"saved": saved, "end": pieces(model, optim), "losses": losses}


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> dict:
    root = str(tmp_path_factory.mktemp("ep"))
    out = run_ranks(_train_and_save, 4, root, timeout=300)
    return {
        "path": os.path.join(root, "src"),
        "root": root,
        "saved": assemble([o["saved"] for o in out]),
        "end": [o["end"] for o in out],
        "losses": [o["losses"] for o in out],
    }


def test_manifest_records_every_expert_and_who_held_it(source):
    with CheckpointReader(source["path"]) as reader:
        writer = reader.manifest["writer"]
        groups = reader.read("optim.param_groups")
        keys = reader.keys()
    assert writer["world_size"] == 4
    assert writer["experts"] == {"ep_size": 4, "owners": [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]}
    plan = ModelPlan.from_dict(writer["plan"])
    names = set(plan.params())
    assert {f"{FC1}{e}" for e in range(12)} <= names  # every expert of every EP rank, once
    assert {k[len("model.") :] for k in keys if k.startswith("model.")} == names
    experts = [b for b in plan.buffers if b.is_expert]
    assert len(experts) == 2 * 4 and all(
        b.placement.group == "edp" and b.group_size == 1 and b.grad_divisor == 4 for b in experts
    )
    layer0 = [b for b in plan.buffers if b.prefix == "decoder.layers.0."]
    assert [b.is_expert for b in layer0] == [False, True, True, True, True]
    assert layer0[2].names == tuple(f"mlp.experts.linear_fc{i}.weight{e}" for i in (1, 2) for e in (3, 4, 5))
    # the optimizer's groups name every parameter of every rank
    assert len(groups) == 1 and set(groups[0]["params"]) == names


def test_resume_at_the_same_layout_is_bitwise(ranks, source):
    out = ranks(_resume, 4, source["path"], timeout=300)
    for rank, (o, losses, end) in enumerate(zip(out, source["losses"], source["end"])):
        assert o["losses"] == losses, rank
        assert sorted(o["end"]) == sorted(end)
        for key, (_shape, lo, hi, values) in end.items():
            got = o["end"][key]
            assert got[1:3] == (lo, hi) and torch.equal(got[3], values), (rank, key)


def _resume(path: str) -> dict:
    model, optim = build(4, seed=5)  # other weights: the load must replace them
    extra = mfsdp_ckpt.load(path, model, optim)
    losses = train(model, optim, extra["step"], STEPS + MORE)
    return {"losses": losses, "end": pieces(model, optim)}


# ---- online: load at other (W, EP), save there, load back at (4, 4) -----------------------------


def _load_and_save(root: str, ep: int) -> dict:
    world = dist.get_world_size() if dist.is_initialized() else 1
    model, optim = build(ep, seed=7)
    extra = mfsdp_ckpt.load(os.path.join(root, "src"), model, optim)
    mfsdp_ckpt.save(os.path.join(root, f"w{world}_ep{ep}"), model, optim, extra=extra, update_latest=False)
    return pieces(model, optim)


def _at_4_1_then_back_to_4_4(root: str, others: list[str]) -> dict:
    out = {"w4_ep1": _load_and_save(root, 1)}
    for name in [*others, "w4_ep1"]:
        model, optim = build(4, seed=9)
        mfsdp_ckpt.load(os.path.join(root, name), model, optim)
        out[f"back_from_{name}"] = pieces(model, optim)
    return out


@pytest.mark.heavy
def test_load_at_other_ep_sizes_and_back(ranks, source):
    root, expected = source["root"], source["saved"]
    at = {
        "w2_ep2": assemble(ranks(_load_and_save, 2, root, 2, timeout=300)),
        "w3_ep3": assemble(ranks(_load_and_save, 3, root, 3, timeout=300)),
        "w1_ep1": assemble([_load_and_save(root, 1)]),
    }  # no process group
    back = ranks(_at_4_1_then_back_to_4_4, 4, root, ["w2_ep2", "w3_ep3", "w1_ep1"], timeout=300)
    at["w4_ep1"] = assemble([b["w4_ep1"] for b in back])
    for name, full in at.items():
        assert_same(expected, full, f"loaded at {name}")
        assert_same(expected, assemble([b[f"back_from_{name}"] for b in back]), f"saved at {name}, loaded at (4, 4)")
    for name, ep in (("w2_ep2", 2), ("w3_ep3", 3), ("w1_ep1", 1), ("w4_ep1", 1)):
        with CheckpointReader(os.path.join(root, name)) as reader:
            n = 12 // ep
            assert reader.manifest["writer"]["experts"] == {
                "ep_size": ep,
                "owners": [list(range(p * n, (p + 1) * n)) for p in range(ep)],
            }
        assert diff_checkpoints(source["path"], os.path.join(root, name)).equal, name


# ---- offline: reshard --ep, then load online -------------------------------------------------


def _reshard_cli(*args: str, subprocess_run: bool = False) -> tuple[int, str]:
    """``mfsdp-ckpt reshard ARGS``: exit code and output (stdout and stderr)."""
    if subprocess_run:
        from tests.torchrun import ENV

        out = subprocess.run(
            [sys.executable, "-m", "cli.main", "reshard", *args],
            cwd=ROOT,
            env=ENV,
            capture_output=True,
            text=True,
            timeout=300,
        )
        return out.returncode, out.stdout + out.stderr
    res = CliRunner().invoke(main, ["reshard", *args])
    return res.exit_code, res.output


def _owner_of_chunks(ckpt: str) -> dict[str, set[tuple[str, int]]]:
    """For every parameter-shaped key: the (file, global rank owning the chunk's first element)
    pairs of its chunks, from the recorded plan and ``writer.experts``: shard rank k of EP rank
    p's expert buffer is global rank ``k·E + p``; of a dense buffer, rank k."""
    with CheckpointReader(ckpt) as reader:
        writer = reader.manifest["writer"]
        plan = ModelPlan.from_dict(writer["plan"])
        ep = writer["experts"]["ep_size"]
        owner = {e: p for p, experts in enumerate(writer["experts"]["owners"]) for e in experts}
        out: dict[str, set] = {}
        for spec in plan.buffers:
            for i, name in enumerate(spec.fqns):
                if spec.placement.group == "edp":
                    p = owner[int(name[len(name.rstrip("0123456789")) :])]

                    def global_rank(k: int, p: int = p) -> int:
                        return k * ep + p

                else:
                    assert spec.placement.group == "dp"

                    def global_rank(k: int) -> int:
                        return k

                for key in [k for k in reader.keys() if k == f"model.{name}" or k.startswith(f"optim.{name}.")]:
                    md = reader.metadata.state_dict_metadata[key]
                    if tuple(md.size) != tuple(spec.shapes[i]):
                        continue  # AdamW's step
                    for index, info in reader.metadata.storage_data.items():
                        if index.fqn == key:
                            start = sum(o * md.size[d + 1 :].numel() for d, o in enumerate(index.offset))
                            k = next(
                                k
                                for k in range(spec.layout.group_size)
                                if spec.layout.piece(i, k).start <= start < spec.layout.piece(i, k).end
                            )
                            out.setdefault(key, set()).add((info.relative_path, global_rank(k)))
    return out


def _load_resharded(path: str, ep: int, native: str) -> dict:
    """At (this world, ``ep``): load ``path`` noting the files this rank reads, then save the
    same state natively at ``native``."""
    from mfsdp_ckpt.read import dcp_reader as storage

    model, optim = build(ep, seed=11)
    opened: dict[str, set[str]] = {}
    original = storage.VerifyingReader.read_data

    def spy(self, plan, planner):
        for req in plan.items:
            opened.setdefault(self.storage_data[req.storage_index].relative_path, set()).add(req.storage_index.fqn)
        return original(self, plan, planner)

    storage.VerifyingReader.read_data = spy
    try:
        mfsdp_ckpt.load(path, model, optim)
    finally:
        storage.VerifyingReader.read_data = original
    mfsdp_ckpt.save(native, model, optim, update_latest=False)
    return {"pieces": pieces(model, optim), "opened": opened}


@pytest.mark.heavy
def test_reshard_ep_offline_then_load_online(ranks, source, tmp_path):
    src = source["path"]
    for world, ep, via_subprocess in ((4, 2, False), (2, 1, False), (3, 3, True)):
        dst, native = str(tmp_path / f"w{world}_ep{ep}"), str(tmp_path / f"native_w{world}_ep{ep}")
        code, output = _reshard_cli(
            src, dst, "--world-size", str(world), "--ep", str(ep), subprocess_run=via_subprocess
        )
        assert code == 0, output
        assert f"in {world} file(s) for world size {world}, EP size {ep}" in output
        assert verify_checkpoint(dst) == [] and diff_checkpoints(src, dst).equal
        n = 12 // ep
        with CheckpointReader(dst) as reader:
            writer = reader.manifest["writer"]
        assert writer["experts"] == {"ep_size": ep, "owners": [list(range(p * n, (p + 1) * n)) for p in range(ep)]}
        assert writer["plan"]["group_sizes"] == {"dp": world, "ep": ep, "edp": world // ep}

        # every chunk in the file of the target rank owning it; every rank's file used
        owners = _owner_of_chunks(dst)
        assert {r for pairs in owners.values() for _, r in pairs} == set(range(world))
        misplaced = [(key, f, r) for key, pairs in owners.items() for f, r in pairs if f != f"__{r}_0.distcp"]
        assert not misplaced, misplaced[:5]

        out = ranks(_load_resharded, world, dst, ep, native, timeout=300)
        assert_same(source["saved"], assemble([o["pieces"] for o in out]), f"resharded to ({world}, {ep})")
        for r, o in enumerate(out):
            own = o["opened"].pop(f"__{r}_0.distcp")
            assert any(k.startswith("model.") and ".experts." in k for k in own), (r, sorted(own)[:5])
            shared = o["opened"].pop("__0_0.distcp", set())
            assert not o["opened"], (r, o["opened"].keys())  # no other rank's file
            assert all(k.startswith("extra.") or k == "optim.param_groups" or k.endswith(".step") for k in shared), (
                shared
            )
        # the runtime at (world, ep) records the plan reshard computed
        with CheckpointReader(native) as reader:
            assert reader.manifest["writer"]["plan"] == writer["plan"]
            assert reader.manifest["writer"]["experts"] == writer["experts"]


def test_reshard_to_the_same_layout_keeps_the_plan(source, tmp_path):
    code, output = _reshard_cli(source["path"], str(tmp_path / "same"), "--world-size", "4")  # EP size: the writer's
    assert code == 0, output
    with CheckpointReader(source["path"]) as a, CheckpointReader(tmp_path / "same") as b:
        assert a.manifest["writer"] == b.manifest["writer"]
        assert b.manifest["resharded_from"]["ep_size"] == 4


def _dense_checkpoint(path: str) -> str:
    from tests.mfsdp_ckpt.util import build as build_dense

    model, optim = build_dense("optim_grads_params", "row")
    mfsdp_ckpt.save(path, model, optim, update_latest=False)
    return path


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--world-size", "4", "--ep", "3"], "--ep 3 does not divide --world-size 4"),
        (["--world-size", "10", "--ep", "5"], "--ep 5 does not divide the number of experts in the checkpoint, 12"),
        (["--world-size", "24", "--ep", "24"], "--ep 24 exceeds the number of experts in the checkpoint, 12"),
        (["--world-size", "4", "--ep", "0"], "--ep must be >= 1, got 0"),
        (["--world-size", "2"], "the source's EP size 4 (pass --ep) does not divide --world-size 2"),
        (["--world-size", "4", "--ep", "2", "--dense"], "--ep 2: the checkpoint has no experts"),
    ],
)
def test_reshard_refuses_ep_it_cannot_place(source, tmp_path, args, needle):
    src = source["path"]
    if "--dense" in args:
        args = [a for a in args if a != "--dense"]
        src = _dense_checkpoint(str(tmp_path / "dense"))
    dst = tmp_path / "out"
    code, output = _reshard_cli(src, str(dst), *args)
    assert code == 1, output
    assert needle in output and len(output.strip().splitlines()) == 1, output
    assert not dst.exists() and not [n for n in os.listdir(tmp_path) if ".partial-" in n]


def test_reshard_refuses_through_a_subprocess(source, tmp_path):
    code, output = _reshard_cli(
        source["path"], str(tmp_path / "out"), "--world-size", "6", "--ep", "4", subprocess_run=True
    )
    assert code == 1 and output.strip() == "error: --ep 4 does not divide --world-size 6", output
    assert not (tmp_path / "out").exists()


# ---- failed loads: refused alike on every rank, nothing changes ---------------------------------


def _without(src: str, path: str, drop: set[str]) -> str:
    """A copy of ``src`` without the keys ``drop`` (as a damaged or foreign checkpoint)."""
    with CheckpointReader(src) as reader:
        manifest = {k: reader.manifest[k] for k in ("writer", "step", "has_optimizer", "include_grads")}
        with CheckpointBuilder(path, manifest) as b:
            for key in reader.keys():
                if key in drop:
                    continue
                value = reader.read(key)
                if isinstance(value, torch.Tensor):
                    b.add_tensor(key, value)
                else:
                    b.add_object(key, value)
            b.commit()
    return path


def _failed_loads(src: str, lacking: str) -> dict:
    out = {}
    for name, path, config in (("experts", src, dataclasses.replace(CFG, num_experts=6)), ("lacking", lacking, CFG)):
        model, optim = build(2, seed=3, config=config)
        train(model, optim, 0, 1)
        before = state_of(model, optim)
        try:
            mfsdp_ckpt.load(path, model, optim)
            out[name] = "loaded"
        except mfsdp_ckpt.CheckpointError as e:
            out[name] = f"{type(e).__name__}: {e}"
        after = state_of(model, optim)
        out[f"{name}_unchanged"] = sorted(before) == sorted(after) and all(
            torch.equal(before[k], after[k]) for k in before
        )
    return out


def test_failed_loads_are_refused_alike_and_change_nothing(ranks, source, tmp_path):
    lacking_key = f"optim.{FC1}11.exp_avg"  # only EP rank 1 (experts 6-11) wants it at (2, 2)
    lacking = _without(source["path"], str(tmp_path / "lacking"), {lacking_key})
    out = ranks(_failed_loads, 2, source["path"], lacking, timeout=300)
    assert out[0] == out[1], out  # every rank raises the same error
    experts = out[0]["experts"]
    assert experts.startswith("StateMismatchError: ") and len(experts.splitlines()) == 1
    assert f"the checkpoint has 12 experts in '{FC1}{{e}}', the model 6" in experts, experts
    assert out[0]["lacking"] == f"StateMismatchError: {lacking}: missing from the checkpoint: {lacking_key}"
    assert out[0]["experts_unchanged"] and out[0]["lacking_unchanged"]


def test_expert_count_mismatch_without_a_process_group(source):
    for num in (4, 24):
        model, optim = build(1, seed=3, config=dataclasses.replace(CFG, num_experts=num))
        train(model, optim, 0, 1)
        before = state_of(model, optim)
        with pytest.raises(mfsdp_ckpt.StateMismatchError) as e:
            mfsdp_ckpt.load(source["path"], model, optim)
        assert f"the checkpoint has 12 experts in '{FC1}{{e}}', the model {num}" in str(e.value)
        after = state_of(model, optim)
        assert all(torch.equal(before[k], after[k]) for k in before)


# ---- inspect -------------------------------------------------------------------------------


def test_inspect_shows_the_expert_placement(source, tmp_path):
    res = CliRunner().invoke(main, ["inspect", source["path"]])
    assert res.exit_code == 0, res.output
    assert "experts     EP size 4, 12 experts" in res.output
    for p in range(4):
        assert f"  EP rank {p}: ranks {p}; experts {3 * p}-{3 * p + 2}" in res.output
    code, output = _reshard_cli(source["path"], str(tmp_path / "w4_ep2"), "--world-size", "4", "--ep", "2")
    assert code == 0, output
    data = json.loads(CliRunner().invoke(main, ["inspect", "--json", str(tmp_path / "w4_ep2")]).output)
    assert data["experts"] == {
        "ep_size": 2,
        "num_experts": 12,
        "placement": [
            {"ep_rank": 0, "ranks": [0, 2], "experts": list(range(6))},
            {"ep_rank": 1, "ranks": [1, 3], "experts": list(range(6, 12))},
        ],
    }
    assert (
        "  EP rank 1: ranks 1, 3; experts 6-11"
        in CliRunner().invoke(main, ["inspect", str(tmp_path / "w4_ep2")]).output
    )
    assert inspect_checkpoint(_dense_checkpoint(str(tmp_path / "dense"))).experts is None
    assert "experts " not in CliRunner().invoke(main, ["inspect", str(tmp_path / "dense")]).output


def test_reshard_ep_of_an_moe_checkpoint_trained_without_ep(source, tmp_path):
    """Experts over ``dp`` (no expert mesh) take the expert placement: the same target as from
    the expert-parallel checkpoint of the same model."""
    torch.manual_seed(0)
    model = GPTModel(CFG)
    for unit in shard_units(model):
        fully_shard(unit, strategy="optim_grads_params", policy="even")
    optim = fully_shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))
    train(model, optim, 0, 1)
    plain = mfsdp_ckpt.save(str(tmp_path / "plain"), model, optim, update_latest=False)
    with CheckpointReader(plain) as reader:
        assert "experts" not in reader.manifest["writer"]
    code, output = _reshard_cli(plain, str(tmp_path / "plain_w4_ep2"), "--world-size", "4", "--ep", "2")
    assert code == 0, output
    code, output = _reshard_cli(source["path"], str(tmp_path / "ep_w4_ep2"), "--world-size", "4", "--ep", "2")
    assert code == 0, output
    with CheckpointReader(tmp_path / "plain_w4_ep2") as a, CheckpointReader(tmp_path / "ep_w4_ep2") as b:
        assert a.manifest["writer"]["plan"] == b.manifest["writer"]["plan"]
        assert a.manifest["writer"]["experts"] == b.manifest["writer"]["experts"]
    assert diff_checkpoints(plain, tmp_path / "plain_w4_ep2").equal
    misplaced = [
        (k, f, r)
        for k, pairs in _owner_of_chunks(str(tmp_path / "plain_w4_ep2")).items()
        for f, r in pairs
        if f != f"__{r}_0.distcp"
    ]
    assert not misplaced, misplaced[:5]
    # without --ep it stays as it was: experts over dp, no writer.experts
    code, output = _reshard_cli(plain, str(tmp_path / "plain_w3"), "--world-size", "3")
    assert code == 0 and "EP size" not in output, output
    with CheckpointReader(tmp_path / "plain_w3") as reader:
        assert {b["group"] for b in reader.manifest["writer"]["plan"]["buffers"]} == {"dp"}
        assert "experts" not in reader.manifest["writer"]


# ---- pure parts: the manifest's writer.experts, merged optimizer groups -----------------------


@pytest.mark.parametrize(
    "experts, field, problem",
    [
        ({"ep_size": 0, "owners": []}, "writer.experts.ep_size", "outside [1, 65536]"),
        ({"ep_size": 2, "owners": [[0, 1]]}, "writer.experts.owners", "1 entries for EP size 2"),
        ({"ep_size": 2, "owners": [[0, 1], [1, 2]]}, "writer.experts.owners[1]", "expert 1 is listed twice"),
        ({"ep_size": 1, "owners": [[-1]]}, "writer.experts.owners[0][0]", "outside [0, 16777216]"),
        ({"ep_size": 1, "owners": "all"}, "writer.experts.owners", "expected a list"),
        ({"ep_size": 1}, "writer.experts.owners", "missing"),
    ],
)
def test_manifest_schema_bounds_writer_experts(experts, field, problem):
    from mfsdp_ckpt.format.manifest_schema import check_manifest

    check_manifest(
        {"format": "mfsdp-ckpt", "chunks": {}, "writer": {"experts": {"ep_size": 2, "owners": [[0], [1]]}}}, "m"
    )
    with pytest.raises(mfsdp_ckpt.CorruptCheckpointError) as e:
        check_manifest({"format": "mfsdp-ckpt", "chunks": {}, "writer": {"experts": experts}}, "m")
    assert str(e.value).startswith(f"m: field '{field}': ") and problem in str(e.value), str(e.value)


def test_merged_param_groups_name_every_parameter_in_model_order():
    from mfsdp_ckpt.model.experts import merge_param_groups

    rank0 = [
        {"lr": 0.1, "params": ["a", "x.experts.w0", "x.experts.w1", "x.experts.v0", "x.experts.v1", "b"]},
        {"lr": 0.2, "params": ["c"]},
    ]
    rank1 = [
        {"lr": 0.1, "params": ["a", "x.experts.w2", "x.experts.w3", "x.experts.v2", "x.experts.v3", "b"]},
        {"lr": 0.2, "params": ["c"]},
    ]
    merged = merge_param_groups([rank0, rank1])
    assert merged == [
        {
            "lr": 0.1,
            "params": [
                "a",
                "x.experts.w0",
                "x.experts.w1",
                "x.experts.w2",
                "x.experts.w3",
                "x.experts.v0",
                "x.experts.v1",
                "x.experts.v2",
                "x.experts.v3",
                "b",
            ],
        },
        {"lr": 0.2, "params": ["c"]},
    ]
    with pytest.raises(
        mfsdp_ckpt.CheckpointError, match=r"^save: the optimizer has 2 parameter group\(s\) on rank 0 but 1 on rank 1"
    ):
        merge_param_groups([rank0, rank1[:1]])
    with pytest.raises(
        mfsdp_ckpt.CheckpointError, match=r"^save: optimizer param_groups\[1\] differs between rank 0 and rank 1 in lr"
    ):
        merge_param_groups([rank0, [rank1[0], {"lr": 0.3, "params": ["c"]}]])
