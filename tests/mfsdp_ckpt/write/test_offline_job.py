"""``mfsdp_ckpt.write.job``: who writes which output file (a function of the files' sizes only),
where a data file is cut, and the agreement on failures over real gloo processes."""

from __future__ import annotations

import torch.distributed as dist

from mfsdp_ckpt.errors import CheckpointError, JobFailedElsewhere
from mfsdp_ckpt.write.agreement import Job
from mfsdp_ckpt.write.builder import ChunkRecord
from mfsdp_ckpt.write.job import record_order, split_by_size


def test_owners_are_the_same_on_every_process_and_balance_the_bytes():
    sizes = [50, 10, 40, 30, 30, 0, 20]
    owners = [Job(r, 3).owners(sizes) for r in range(3)]
    assert owners[0] == owners[1] == owners[2]
    loads = [sum(s for s, p in zip(sizes, owners[0]) if p == r) for r in range(3)]
    assert sorted(loads) == [60, 60, 60]
    assert sorted(f for r in range(3) for f in Job(r, 3).mine(sizes)) == list(range(len(sizes)))
    assert Job().mine(sizes) == list(range(len(sizes)))  # alone: every file
    assert Job(4, 5).mine([7, 7]) == []  # more processes than files: some write none


def test_split_by_size_cuts_before_the_item_that_would_overflow():
    assert split_by_size([5, 5, 5, 20, 1, 0], 10) == [0, 0, 1, 2, 3, 3]
    assert split_by_size([3, 3], 100) == [0, 0]  # under the size: one file, as before
    assert split_by_size([], 10) == []


def test_records_are_listed_by_file_then_offset():
    def rec(file: str, offset: int) -> ChunkRecord:
        return ChunkRecord("k", None, (), (), (), file, offset, 1, 0)

    shuffled = [rec("__10_0.distcp", 0), rec("__2_0.distcp", 9), rec("__2_0.distcp", 3), rec("__0_1.distcp", 0)]
    ordered = sorted(shuffled, key=record_order)
    assert [(r.file, r.offset) for r in ordered] == [
        ("__0_1.distcp", 0),
        ("__2_0.distcp", 3),
        ("__2_0.distcp", 9),
        ("__10_0.distcp", 0),
    ]


def _fails_on(rank: int) -> str:
    def work() -> int:
        if dist.get_rank() == rank:
            raise CheckpointError(f"bad chunk on rank {rank}")
        return dist.get_rank()

    try:
        return f"ok {Job.current().run('out: not written', work)}"
    except JobFailedElsewhere as e:
        return f"elsewhere {e.rank}: {e}"
    except CheckpointError as e:
        return f"own: {e}"


def test_a_failure_is_raised_everywhere_in_the_words_of_the_process_that_hit_it(ranks):
    out = ranks(_fails_on, 3, 1, timeout=120)
    assert out[1] == "own: bad chunk on rank 1"
    for r in (0, 2):
        assert out[r] == "elsewhere 1: out: not written: rank 1 failed (CheckpointError: bad chunk on rank 1)"
    assert ranks(_fails_on, 3, 7, timeout=120) == ["ok 0", "ok 1", "ok 2"]
