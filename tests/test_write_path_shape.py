"""One write path (issue 53): every writer opens, commits and aborts its output through
``mfsdp_ckpt.write.destination``, ranks agree in ``mfsdp_ckpt.write.agreement``, and there is one
``write_and_commit``. These checks keep a second path from growing back."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: the places above storage/ that still ask whether a path is local, each for a reason no
#: destination has: the one decision of the writers, MCore checkpoints read from local
#: directories only, an object store keeping no modification time for a prefix, page-cache advice
#: existing for local files only
IS_LOCAL_ALLOWED = {
    "mfsdp_ckpt/write/destination.py",
    "mfsdp_ckpt/read/resolve.py",
    "mfsdp_ckpt/tools/listing.py",
    "mfsdp_ckpt/sharded/reshard.py",
}
#: what opens, commits or cleans a destination: storage/'s primitives, called from the seam only
DESTINATION_PRIMITIVES = re.compile(
    r"\b(run_lock|check_destination|make_partial_dir|partial_path|commit_directory|remove_leftovers|"
    r"remove_uncommitted|check_bucket|check_writable_prefix)\("
)
#: where ranks agree: the agreement module, and rank0_decides in the runtime's collectives
AGREEMENT = re.compile(r"\b(gather_object|broadcast_object_list|all_gather_object)\(")


def _sources() -> dict[str, str]:
    return {
        p.relative_to(ROOT).as_posix(): p.read_text()
        for d in ("mfsdp_ckpt", "cli")
        for p in sorted((ROOT / d).rglob("*.py"))
    }


def test_one_write_and_commit_and_no_remote_flags():
    sources = _sources()
    defs = [path for path, text in sources.items() if re.search(r"^def write_and_commit\(", text, re.M)]
    assert defs == ["mfsdp_ckpt/write/job.py"]
    assert [path for path, text in sources.items() if re.search(r"\bself\.remote\b", text)] == []


def test_local_or_object_store_is_decided_by_the_destination():
    above = {
        path
        for path, text in _sources().items()
        if not path.startswith("mfsdp_ckpt/storage/") and re.search(r"\bfs\.is_local\(", text)
    }
    assert above <= IS_LOCAL_ALLOWED, sorted(above - IS_LOCAL_ALLOWED)


def test_only_the_destination_opens_commits_and_cleans():
    callers = {
        path
        for path, text in _sources().items()
        if not path.startswith("mfsdp_ckpt/storage/") and DESTINATION_PRIMITIVES.search(text)
    }
    assert callers == {"mfsdp_ckpt/write/destination.py"}, sorted(callers)


def test_ranks_agree_in_one_module():
    callers = {path for path, text in _sources().items() if AGREEMENT.search(text)}
    assert callers <= {"mfsdp_ckpt/write/agreement.py"}, sorted(callers)
