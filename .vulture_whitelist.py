# ruff: noqa: B018 (vulture's whitelist format: each line an attribute access that marks a name as used)
"""Names the dead-code check (``make lint``, ``.ci/dead_code.py``) takes as used although nothing
in ``mfsdp_ckpt``, ``mfsdp_core`` or ``cli`` uses them. Only three kinds belong here: public API
that users or tests call (documented or imported by tests/ and bench/), hooks that torch, click,
Python or Megatron-Core call by name, and fields read by equality or by a test. A function that only
its own test calls is dead: delete both rather than list it. Written as ``_.name`` (vulture counts
any attribute name as used)."""

from vulture.whitelist_utils import Whitelist

_ = Whitelist()

# Python protocols: PEP 562 lazy module attributes, the module-class swap, file objects, exceptions
_.__getattr__
_.__dir__
_.__class__
_.__traceback__
_.readable
_.seekable
_.writable

# click: the commands of cli/main.py (registered by decorator) and the root's --debug, which
# cli/common.py reads from the click context
_.inspect
_.verify
_.diff
_.debug

# torch.distributed.checkpoint's planner and storage interfaces (called by DCP)
_.read_data
_.lookup_tensor
_.original_state_dict
_.validate_checkpoint_id

# Megatron-Core reads this attribute of the model it wraps
_.main_loss_backward_scale

# Strategy("optim"): the enum member is looked up by value
_.OPTIM

# hf/files.py _FileId: dataclass fields compared by equality
_.dev
_.ino
_.mtime_ns

# public API for users (README, docs/) and the tests that exercise it
_.set_overlap  # README, docs/runtime.md
_.mx_placement  # README
_.muon_param_groups  # docs/runtime.md
_.count_comm  # mfsdp_core's public face; tests/mfsdp_core/test_overlap.py
_.expert_owner  # mfsdp_core.expert_parallel re-exports it; tests/mfsdp_core/test_expert_parallel.py
_.register  # mfsdp_ckpt.hf: registers an architecture; tests/mfsdp_ckpt/hf/test_mapping.py
_.shared_expert  # the architecture tables' predicates, for a registered architecture; test_mapping.py
_.estimated_param_bytes  # docs/guarantees.md
_.write_dcp  # the Python API of convert; tests/cli/test_roundtrip_convert.py and others
_.load_with_state_dict_hooks  # docs/torchtitan.md; tests/titan/test_torchtitan.py
_.simulate  # tools/plan_sim.py: tests/mfsdp_ckpt/format/test_plan_derivation.py, bench/plan_scale.py
_.same_plan_as_dcp
_.prime_adamw_state
_.planning_s
_.staging_bytes  # bench/ckpt_io.py, bench/async_train.py

# read by tests and bench as probes of what the code did
_.chunk_table  # the chunks of a checkpoint: tests that corrupt one
_.stack_of  # tests/mfsdp_ckpt/mcore/test_mcore_inputs.py
_.io_priority  # tests/mfsdp_ckpt/sharded/test_async_priority.py
_.bytes_read  # tests/mfsdp_ckpt/mcore/test_mcore_inputs.py
_.staged_s  # tests/mfsdp_ckpt/sharded/test_async_fence.py, bench/async_train.py
_.wait_staged  # tests/mfsdp_ckpt/sharded/test_async_fence.py
_.issued_ns  # tests/mfsdp_core/test_overlap.py
_.ops  # tests/mfsdp_core/test_fully_shard.py and others
_.released  # tests/mfsdp_core/test_fully_shard.py
_.project_qkv  # tests/mfsdp_core/test_gpt.py, tests/mfsdp_ckpt/hf/test_mapping.py
_.tokens_received  # tests/mfsdp_core/test_expert_parallel.py

# cli/settings.py's LaunchSettings: torchrun's flags, passed on by name (cli/train_launch.py's
# _torchrun_argv reads each of _LAUNCH_FLAGS with getattr)
_.node_rank
_.rdzv_backend
_.rdzv_id
_.rdzv_conf
_.master_port
_.max_restarts

# the memory tier's synchronous snapshot: public API (docs/memory_tier.md), called by tests/ and
# bench/ (the trainer takes async_snapshot)
_.snapshot
