"""Save planning and checkpoint metadata at scale: ours (every rank derives the plan alone; a
compact index in ``mfsdp.json``) against PyTorch DCP's default planner (every local plan gathered,
deduplicated and validated on the coordinator; a pickled ``.metadata`` every rank unpickles).

The job is simulated in one process (:mod:`mfsdp_ckpt.tools.plan_sim`): W virtual ranks, each
building the model on the meta device and sharding it with the real ``fully_shard`` inside
PyTorch's fake process group. Model: ``--tensors`` tensors (units of 5 ``Linear(d, d)`` with
biases), ZeRO-3 ``even``, AdamW state. Per W, one run:

- ours: ``planning_s``, the worst of three ranks (first, middle, last) for what a rank computes
  before writing (the global plan and its fingerprint, the catalog once the mesh is known, its
  entries and write plan; the one small all-gather is not a computation); ``index_mb``, the whole
  ``mfsdp.json`` (plan, index, files); ``index_load_s``, a resuming rank (the worse of the first
  and the last) going from the manifest's bytes to the place and crc32c of every chunk it reads
  (JSON parse, the catalog with every key checked against its layout, the chunks overlapping its
  shard, the record tables of the ranks that wrote them); also, not a target: every key's whole
  chunk list (``all_chunks_s``) and every rank's record table (``all_tables_s``), what ``verify``
  walks, and rank 0's commit (``commit_s``: every rank's writes checked against the catalog,
  ``.metadata`` and the index built). The simulation's heap (every virtual rank's model) is
  frozen out of the garbage collector before anything is timed: a real rank holds one model;
- DCP: ``dcp_planning_s``, ``create_global_plan`` (dedup, metadata, validation) over all W
  local plans; ``dcp_metadata_mb``, the pickled ``.metadata`` (with a storage entry per chunk);
  ``dcp_load_s``, unpickling it.

Then a DeepSeek-V3-scale job (61 layers, the first 3 dense, 256 routed + 1 shared experts per MoE
layer, EP 64, W = 2,048, the real dimensions): three ranks built for real (EP ranks 0 and 1,
the last rank), the other ranks' places in the mesh from the EP grid rule the runtime uses
(their models would only repeat rank 0's with other expert names). No DCP row: gathering 2,048
local plans of that model does not fit a laptop's patience.

    python bench/plan_scale.py [--worlds 64,256,1024] [--tensors 500] [--no-deepseek] [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import pickle
import sys
import tempfile
import time
import warnings

import torch
from torch import nn
from torch.distributed.checkpoint.filesystem import _StorageInfo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from mfsdp_ckpt.format.catalog import Catalog, KeyInfo, Mesh, param_of_key, plan_of_placed, replace_keys  # noqa: E402
from mfsdp_ckpt.format.checksum import chunk_id  # noqa: E402
from mfsdp_ckpt.format.manifest import writer_layout  # noqa: E402
from mfsdp_ckpt.format.record_table import DataFile, Record, encode_table, table_crc  # noqa: E402
from mfsdp_ckpt.read.indexed import IndexedCheckpoint  # noqa: E402
from mfsdp_ckpt.sharded.planner import MfsdpSavePlanner  # noqa: E402
from mfsdp_ckpt.sharded.save_layout import derive, mesh_position, writes_of  # noqa: E402
from mfsdp_ckpt.sharded.state import save_entries  # noqa: E402
from mfsdp_ckpt.tools.plan_sim import fake_rank, prime_adamw_state, simulate  # noqa: E402
from mfsdp_core import describe_shards, fully_shard, fully_shard_optimizer  # noqa: E402

warnings.filterwarnings("ignore")


class Unit(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(5))


class Stack(nn.Module):
    def __init__(self, units: int, d: int) -> None:
        super().__init__()
        self.units = nn.ModuleList(Unit(d) for _ in range(units))


def _stack_builder(tensors: int, d: int):
    def build(rank: int):
        with torch.device("meta"):
            model = Stack(tensors // 10, d)
        for unit in model.units:
            fully_shard(unit)
        model = fully_shard(model)
        optim = fully_shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
        prime_adamw_state(optim)
        return model, optim

    return build


def _rank_planning(sim, rank: int) -> float:
    """What ``rank`` computes before writing, past the derivation the simulation timed."""
    vr = sim.ranks[rank]
    start = time.perf_counter()
    mesh = Mesh.from_positions(sim.world, [v.position for v in sim.ranks])
    catalog = Catalog(vr.placed, mesh)
    for b in range(len(vr.placed)):
        catalog.copies(b)
    entries = save_entries(vr.shards, vr.optimizer, False, writes_of(catalog, rank))
    planner = MfsdpSavePlanner()
    planner.set_up_planner(entries, storage_meta=None, is_coordinator=rank == 0)
    planner.create_local_plan()
    return vr.planning_s + time.perf_counter() - start


def _write_tables(directory: str, plans) -> list[DataFile]:
    """Each rank's data file as its record table alone (empty records): what a reader of the
    index reads besides ``mfsdp.json``."""
    files = []
    for r, plan in enumerate(plans):
        table = encode_table((chunk_id(i.index), Record(0, 0, 0)) for i in plan.items)
        name = f"__{r}_0.distcp"
        with open(os.path.join(directory, name), "wb") as f:
            f.write(table)
        files.append(DataFile(name, r, len(table), len(plan.items), table_crc(table)))
    return files


def _manifest(world: int, index: dict, files: list[DataFile], plan, experts=None) -> bytes:
    manifest = {
        "format": "mfsdp-ckpt",
        "writer": writer_layout(world, plan, experts),
        "index": {**index, "files": [f.to_list() for f in files]},
    }
    return (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode()


def _wanted(sim, rank: int, keys) -> list[tuple[str, int, int]]:
    """What ``rank`` reads on a resume: each per-element key of its parameters, over the
    elements its shard owns (``ParamShard.owned``, as the load asks for them)."""
    owned = {ps.fqn: ps.owned for ps in sim.ranks[rank].shards}
    out = []
    for key in keys:
        fqn = param_of_key(key)
        if fqn in owned and owned[fqn][1] > owned[fqn][0]:
            out.append((key, *owned[fqn]))
    return out


def _load_index(directory: str, data: bytes, rank: int, wanted: list[tuple[str, int, int]]) -> float:
    """A resuming rank, from the manifest's bytes to the place and crc32c of every chunk it
    reads: JSON parse, the catalog (every key checked against its layout), then per key the
    chunks overlapping its shard and their records (reading the tables of the ranks that wrote
    them: its own, at the same world size)."""
    start = time.perf_counter()
    manifest = json.loads(data)
    ck = IndexedCheckpoint(directory, manifest)
    for key, lo, hi in wanted:
        ck.stored_within(key, lo, hi)
    return time.perf_counter() - start


def _all_chunks(directory: str, data: bytes) -> float:
    """Every key's whole chunk list derived (what ``verify`` and ``inspect`` walk)."""
    start = time.perf_counter()
    ck = IndexedCheckpoint(directory, json.loads(data))
    for key in ck.keys():
        ck.chunks_of(key)
    return time.perf_counter() - start


def measure_world(world: int, tensors: int, d: int) -> dict:
    t0 = time.perf_counter()
    sim = simulate(world, _stack_builder(tensors, d))
    sim.agree()
    built = time.perf_counter() - t0
    gc.collect()
    gc.freeze()  # a real rank's heap holds one model, not W: keep the collector off the others'
    return _measure_simulated(sim, world, tensors, built)


def _measure_simulated(sim, world: int, tensors: int, built: float) -> dict:
    planning = max(_rank_planning(sim, r) for r in sorted({0, world // 2, world - 1}))
    ours = [sim.local_plan(r) for r in range(world)]
    full = [sim.local_plan(r, derived=False) for r in range(world)]
    start = time.perf_counter()
    metadata, index = sim.commit(ours)
    commit_s = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as tmp:
        files = _write_tables(tmp, ours)
        data = _manifest(world, index, files, plan_of_placed(sim.ranks[0].placed, {"dp": world}))
        with open(os.path.join(tmp, "mfsdp.json"), "wb") as f:
            f.write(data)
        keys = json.loads(data)["index"]["keys"]
        index_load = max(
            min(_load_index(tmp, data, r, _wanted(sim, r, keys)) for _ in range(3)) for r in (0, world - 1)
        )
        all_chunks = _all_chunks(tmp, data)
        start = time.perf_counter()
        ck = IndexedCheckpoint(tmp, json.loads(data))
        for r in range(world):
            ck.table(r)
        all_tables = time.perf_counter() - start
    start = time.perf_counter()
    _, dcp_md = sim.dcp_global(full)
    dcp_planning = time.perf_counter() - start
    dcp_md.storage_data = {
        i.index: _StorageInfo(f"__{r}_0.distcp", 0, 0) for r, p in enumerate(full) for i in p.items
    }  # DCP's finish records every written chunk (the deduplicated ones: one per chunk)
    blob = pickle.dumps(dcp_md)
    start = time.perf_counter()
    pickle.loads(blob)
    dcp_load = time.perf_counter() - start
    chunks = sum(len(p.items) for p in ours)
    gc.unfreeze()
    return {
        "world": world,
        "tensors": tensors,
        "chunks": chunks,
        "planning_s": round(planning, 4),
        "index_mb": round(len(data) / 1e6, 3),
        "index_load_s": round(index_load, 4),
        "all_chunks_s": round(all_chunks, 3),
        "all_tables_s": round(all_tables, 3),
        "commit_s": round(commit_s, 3),
        "dcp_planning_s": round(dcp_planning, 3),
        "dcp_metadata_mb": round(len(blob) / 1e6, 2),
        "dcp_load_s": round(dcp_load, 3),
        "simulated_s": round(built, 1),
    }


# ---- DeepSeek-V3 scale ------------------------------------------------------------------------


def _deepseek_config():
    from mfsdp_core.models.config import get_preset

    return dataclasses.replace(
        get_preset("tiny-deepseek"),
        vocab_size=129280,
        hidden_size=7168,
        num_layers=61,
        num_attention_heads=128,
        num_query_groups=128,
        kv_channels=128,
        ffn_hidden_size=18432,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_head_dim=128,
        qk_pos_emb_head_dim=64,
        v_head_dim=128,
        num_experts=256,
        moe_router_topk=8,
        moe_ffn_hidden_size=2048,
        moe_shared_expert_ffn_hidden_size=2048,
        first_k_dense_replace=3,
        moe_router_num_groups=8,
        moe_router_group_topk=4,
        mtp_num_layers=0,
    )


def measure_deepseek(world: int = 2048, ep: int = 64) -> dict:
    from mfsdp_core.expert_parallel import EDP_GROUP, EP_GROUP, expert_placement, init_expert_mesh
    from mfsdp_core.models.gpt import GPTModel, shard_experts, shard_units

    config = _deepseek_config()
    sampled = {}
    for rank in (0, 1, world - 1):
        with fake_rank(rank, world):
            mesh = init_expert_mesh(ep, config.num_experts)
            with torch.device("meta"):
                model = shard_experts(GPTModel(config), mesh)
            for unit in shard_units(model):
                fully_shard(unit, mesh=mesh.groups, placement=expert_placement("even"))
            optim = fully_shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
            prime_adamw_state(optim)
            shards = describe_shards(model, optim)
            start = time.perf_counter()
            placed, views, digest, groups = derive(model, optim, shards, world, False)
            took = time.perf_counter() - start
            sampled[rank] = (placed, digest, mesh_position(model), shards, optim, took, model)
    if len({s[1] for s in sampled.values()}) != 1:
        raise SystemExit("the sampled ranks derived different plans")
    positions = [{"dp": (0, g), EP_GROUP: (ep * (g // ep), g % ep), EDP_GROUP: (g % ep, g // ep)} for g in range(world)]
    for rank, s in sampled.items():
        assert s[2] == positions[rank], (rank, s[2], positions[rank])  # the rule is what the runtime made
    planning = 0.0
    plans = {}
    for rank, (placed, _, _, shards, optim, took, _) in sampled.items():
        start = time.perf_counter()
        catalog = Catalog(placed, Mesh.from_positions(world, positions))
        for b in range(len(placed)):
            catalog.copies(b)
        entries = save_entries(shards, optim, False, writes_of(catalog, rank))
        planner = MfsdpSavePlanner()
        planner.set_up_planner(entries, storage_meta=None, is_coordinator=rank == 0)
        plans[rank] = planner.create_local_plan()
        planning = max(planning, took + time.perf_counter() - start)
    # the key table: every rank writes keys of the same kinds as rank 0 (dense) and its EP rank's experts
    from mfsdp_core.dtypes import dtype_name
    from mfsdp_core.expert_parallel import expert_index

    placed = sampled[0][0]
    keys = {}
    for item in plans[0].items + plans[1].items:
        key = item.index.fqn
        td = item.tensor_data
        if td is None:
            keys[key] = KeyInfo(None, None, 0)
            continue
        keys[key] = KeyInfo(dtype_name(td.properties.dtype), tuple(td.size), "o" if item.type.name == "SHARD" else 0)
    per_rank = config.num_experts // ep
    for key, info in list(keys.items()):  # the other EP ranks' experts, as their ranks declare them
        body = key.split(".", 1)[1]
        fqn = body.rsplit(".", 1)[0] if key.startswith("optim.") else body
        parsed = expert_index(fqn)
        if parsed is None or info.where != "o":
            continue
        t, e = parsed
        for p in range(ep):
            other = f"{t}{e % per_rank + p * per_rank}"
            keys[key.replace(fqn, other, 1)] = info
    catalog = replace_keys(Catalog(placed, Mesh.from_positions(world, positions)), keys)
    index = {"version": 1, **catalog.to_dict()}
    with tempfile.TemporaryDirectory() as tmp:
        table = encode_table((chunk_id(i.index), Record(0, 0, 0)) for i in plans[0].items)
        with open(os.path.join(tmp, "__0_0.distcp"), "wb") as f:
            f.write(table)
        files = [
            DataFile(f"__{r}_0.distcp", r, len(table), len(plans[0].items), table_crc(table)) for r in range(world)
        ]
        data = _manifest(
            world, index, files, plan_of_placed(placed, {"dp": world, EP_GROUP: ep, EDP_GROUP: world // ep})
        )
        owned = {ps.fqn: ps.owned for ps in sampled[0][3]}
        wanted = [(k, *owned[f]) for k in keys if (f := param_of_key(k)) in owned and owned[f][1] > owned[f][0]]
        start = time.perf_counter()
        ck = IndexedCheckpoint(tmp, json.loads(data))
        for key, lo, hi in wanted:
            ck.stored_within(key, lo, hi)
        load = time.perf_counter() - start
    return {
        "model": "deepseek-v3",
        "world": world,
        "ep": ep,
        "keys": len(keys),
        "params": sum(len(pb.spec.fqns) for pb in placed),
        "planning_s": round(planning, 3),
        "index_mb": round(len(data) / 1e6, 2),
        "index_load_s": round(load, 3),
        "rank0_keys_derived": len(wanted),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", default="64,256,1024")
    parser.add_argument("--tensors", type=int, default=500)
    parser.add_argument("--dim", type=int, default=512, help="d of each Linear(d, d)")
    parser.add_argument("--no-deepseek", action="store_true")
    parser.add_argument("--json", action="store_true", help="end with one line: a JSON list of the rows")
    args = parser.parse_args()
    rows = []
    header = (
        f"{'W':>6} {'chunks':>9} | {'plan s':>8} {'index MB':>9} {'load s':>8} | "
        f"{'DCP plan s':>10} {'.metadata MB':>12} {'unpickle s':>10} | {'plan x':>7} {'size x':>7} {'load x':>7}"
    )
    print(header)
    for world in (int(w) for w in args.worlds.split(",")):
        row = measure_world(world, args.tensors, args.dim)
        rows.append(row)
        print(
            f"{world:>6} {row['chunks']:>9} | {row['planning_s']:>8.3f} {row['index_mb']:>9.3f} {row['index_load_s']:>8.3f} | "
            f"{row['dcp_planning_s']:>10.3f} {row['dcp_metadata_mb']:>12.2f} {row['dcp_load_s']:>10.3f} | "
            f"{row['dcp_planning_s'] / max(row['planning_s'], 1e-9):>7.1f} "
            f"{row['dcp_metadata_mb'] / max(row['index_mb'], 1e-9):>7.1f} "
            f"{row['dcp_load_s'] / max(row['index_load_s'], 1e-9):>7.1f}",
            flush=True,
        )
        print(
            f"       (ours: commit on rank 0 {row['commit_s']} s; every key's whole chunk list {row['all_chunks_s']} s, "
            f"every rank's record table {row['all_tables_s']} s (verify walks both); "
            f"simulated in {row['simulated_s']} s)",
            flush=True,
        )
    if not args.no_deepseek:
        ds = measure_deepseek()
        print(
            f"DeepSeek-V3 scale (W={ds['world']}, EP {ds['ep']}, {ds['params']} parameters, {ds['keys']} keys): "
            f"planning {ds['planning_s']} s per rank, index {ds['index_mb']} MB, "
            f"index load {ds['index_load_s']} s (rank 0's {ds['rank0_keys_derived']} keys)",
            flush=True,
        )
        rows.append(ds)
    if args.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
