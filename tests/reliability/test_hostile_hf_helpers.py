"""Helpers for the hostile-input tests of the Hugging Face import (no tests here).

- tiny valid HF model directories for every built-in architecture, written directly as
  safetensors files (no ``transformers`` needed, so a fuzz case costs milliseconds), with their
  tensor names and shapes taken from the architecture's own mapping;
- raw access to a safetensors file's header, to damage it;
- the guards every hostile case runs under: a time limit (SIGALRM), a watchdog that unblocks a
  reader stuck opening a FIFO (a blocking ``open`` inside C code never returns to Python to see the
  alarm), and an audit of every file the import opens, lists, creates, renames or removes
  (``sys.addaudithook``), so a case fails when anything outside its HF directory and its
  destination is touched.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from safetensors.torch import load_file, save_file

from mfsdp_ckpt.format.names import LOCK_NAME
from mfsdp_ckpt.hf import get_architecture
from mfsdp_ckpt.hf.files import INDEX_NAME, shard_name
from mfsdp_ckpt.hf.mapping import canonical_shapes, expand
from mfsdp_ckpt.read.reader import CheckpointReader
from mfsdp_core.models.gpt import GPTConfig
from tests.reliability.test_hostile_support import Hang, deadline

#: a tiny model per architecture (2 layers; MoE ones with 3 experts)
CONFIGS: dict[str, GPTConfig] = {
    "llama": GPTConfig(
        vocab_size=16,
        hidden_size=8,
        num_layers=2,
        num_attention_heads=2,
        num_query_groups=1,
        kv_channels=4,
        ffn_hidden_size=12,
        seq_length=32,
        rotary_base=10000.0,
        norm_epsilon=1e-6,
    ),
    "qwen2": GPTConfig(
        vocab_size=16,
        hidden_size=8,
        num_layers=2,
        num_attention_heads=2,
        num_query_groups=2,
        kv_channels=4,
        ffn_hidden_size=12,
        seq_length=32,
        add_qkv_bias=True,
        norm_epsilon=1e-6,
    ),
    "qwen3": GPTConfig(
        vocab_size=16,
        hidden_size=8,
        num_layers=2,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=4,
        ffn_hidden_size=12,
        seq_length=32,
        qk_layernorm=True,
        tie_embeddings=True,
        norm_epsilon=1e-6,
    ),
    "mixtral": GPTConfig(
        vocab_size=16,
        hidden_size=8,
        num_layers=2,
        num_attention_heads=2,
        num_query_groups=1,
        kv_channels=4,
        ffn_hidden_size=6,
        seq_length=32,
        num_experts=3,
        moe_router_topk=2,
        moe_ffn_hidden_size=6,
        norm_epsilon=1e-6,
    ),
    "qwen3_moe": GPTConfig(
        vocab_size=16,
        hidden_size=8,
        num_layers=2,
        num_attention_heads=2,
        num_query_groups=1,
        kv_channels=4,
        ffn_hidden_size=12,
        seq_length=32,
        num_experts=3,
        moe_router_topk=1,
        moe_ffn_hidden_size=6,
        qk_layernorm=True,
        norm_epsilon=1e-6,
    ),
}


def hf_tensors_of(arch: str, dtype: torch.dtype = torch.float32, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random HF tensors (in HF key order) of the tiny ``arch`` model, named and shaped as the
    architecture's mapping says."""
    a, cfg = get_architecture(arch), CONFIGS[arch]
    shapes = canonical_shapes(cfg)
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for conv in expand(a, cfg):
        for key, shape in zip(conv.theirs, conv.rule.their_shapes(shapes[conv.ours], cfg)):
            out[key] = (torch.randn(tuple(shape), generator=g) * 0.5).to(dtype)
    return out


def make_hf_dir(
    path: str, arch: str = "llama", *, shards: int = 1, dtype: torch.dtype = torch.float32, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Write a valid HF directory of the tiny ``arch`` model at ``path``: ``config.json`` and one
    ``model.safetensors`` (``shards=1``) or ``shards`` files with an index. Returns the tensors."""
    os.makedirs(path, exist_ok=True)
    tensors = hf_tensors_of(arch, dtype, seed)
    config = {**get_architecture(arch).to_hf_config(CONFIGS[arch]), "torch_dtype": str(dtype).split(".")[-1]}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    keys = list(tensors)
    if shards == 1:
        save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        return tensors
    weight_map: dict[str, str] = {}
    per = -(-len(keys) // shards)
    for k in range(shards):
        name = shard_name(k + 1, shards)
        part = {key: tensors[key] for key in keys[k * per : (k + 1) * per]}
        save_file(part, os.path.join(path, name), metadata={"format": "pt"})
        weight_map.update({key: name for key in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(path, INDEX_NAME), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    return tensors


def read_raw(path: str) -> tuple[dict[str, Any], bytes]:
    """The JSON header (as a dict) and the data section of a safetensors file."""
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8 : 8 + n]), blob[8 + n :]


def write_raw(path: str, header: dict[str, Any] | bytes | str, data: bytes, *, length: int | None = None) -> None:
    """Write a safetensors file from a header (a dict, or the exact JSON text / bytes), the data
    section, and optionally a header length field that lies."""
    if isinstance(header, dict):
        header = json.dumps(header)
    text = header.encode() if isinstance(header, str) else header
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text) if length is None else length))
        f.write(text)
        f.write(data)


def nothing_at(path: str | os.PathLike) -> bool:
    """No ``path`` and no hidden temporary sibling ``.<name>.*`` of it."""
    parent, name = os.path.split(os.path.abspath(path))
    return not os.path.exists(path) and not any(n.startswith(f".{name}.") for n in os.listdir(parent))


def expected_canonical(hf_dir: str, arch: str, cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """What a correct import of ``hf_dir`` holds, computed from the files as the ``safetensors``
    library reads them (an independent reader) and the mapping's merge rules."""
    theirs: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(hf_dir)):
        p = os.path.join(hf_dir, name)
        if name.endswith(".safetensors") and os.path.isfile(p):
            theirs.update(load_file(p))
    return {
        conv.ours: conv.rule.merge([theirs[k] for k in conv.theirs], cfg)
        for conv in expand(get_architecture(arch), cfg)
    }


def assert_correct_import(hf_dir: str, checkpoint: str, arch: str | None = None) -> None:
    """The committed ``checkpoint`` holds exactly what a correct import of ``hf_dir`` holds
    (keys, dtypes, bytes). ``arch``: default, the one the manifest records."""
    with CheckpointReader(checkpoint) as reader:
        cfg = GPTConfig.from_dict(reader.manifest["model_config"])
        arch = arch or reader.manifest["hf"]["architecture"]
        want = expected_canonical(hf_dir, arch, cfg)
        got = {k for k in reader.keys() if k.startswith("model.")}
        assert got == set(want), sorted(got ^ set(want))
        for k, v in want.items():
            t = reader.read(k)
            assert t.dtype == v.dtype and t.shape == v.shape, (k, t.dtype, v.dtype, t.shape, v.shape)
            assert torch.equal(_bits(t), _bits(v)), k


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` (NaN payloads compare equal, unlike values)."""
    return t.contiguous().reshape(-1).view(torch.uint8) if t.numel() else t.reshape(-1)


# --------------------------------------------------------------------------------------------------
# guards


_WATCHDOG = r"""
import os, signal, stat, sys, time
root, after = sys.argv[1], float(sys.argv[2])
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))   # stop between steps: a release is always reported
deadline = time.monotonic() + after
while not stop and time.monotonic() < deadline:
    time.sleep(0.02)
while not stop:
    for dirpath, dirnames, filenames in os.walk(root):
        for n in filenames + dirnames:
            p = os.path.join(dirpath, n)
            try:
                if not stat.S_ISFIFO(os.lstat(p).st_mode):
                    continue
                fd = os.open(p, os.O_WRONLY | os.O_NONBLOCK)   # ENXIO unless a reader is waiting
            except OSError:
                continue
            print("fired", flush=True)
            os.close(fd)
    time.sleep(0.05)
"""


def _fifos_under(root: str) -> bool:
    for dirpath, dirnames, filenames in os.walk(root):
        for n in filenames + dirnames:
            with contextlib.suppress(OSError):
                if stat.S_ISFIFO(os.lstat(os.path.join(dirpath, n)).st_mode):
                    return True
    return False


class FifoWatchdog:
    """When there are FIFOs under ``root``: after ``after`` seconds, a separate process opens
    each for writing (non-blocking), which succeeds only when some reader is blocked opening it,
    and so unblocks that reader. ``fired`` tells whether that happened: a hang the alarm cannot
    interrupt. (A process, not a thread: a reader blocked inside an extension may hold the GIL.)"""

    def __init__(self, root: str, after: float) -> None:
        self.root, self.after = root, after
        self.fired = False
        self._proc: subprocess.Popen | None = None

    def __enter__(self) -> "FifoWatchdog":
        if _fifos_under(self.root):
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _WATCHDOG, self.root, str(self.after)], stdout=subprocess.PIPE, text=True
            )
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                out, _ = self._proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                out, _ = self._proc.communicate()
            self.fired = "fired" in out


_PATH_EVENTS = {
    "open": (0,),
    "os.listdir": (0,),
    "os.scandir": (0,),
    "os.mkdir": (0,),
    "os.rmdir": (0,),
    "os.remove": (0,),
    "os.rename": (0, 1),
    "os.replace": (0, 1),
    "os.link": (0, 1),
    "os.symlink": (0, 1),
    "os.truncate": (0,),
    "os.chmod": (0,),
    "os.chown": (0,),
    "os.utime": (0,),
    "shutil.rmtree": (0,),
    "shutil.copyfile": (0, 1),
    "shutil.move": (0, 1),
    "os.mkfifo": (0,),
    "os.mknod": (0,),
}


@dataclass
class Audit:
    """Records, while :meth:`watch` is active, every path an audited file operation names that
    lies outside ``allowed`` (paths and their contents) and the library / interpreter roots.

    ``sys.addaudithook`` cannot be undone, so one hook is installed per process and stays idle
    outside :meth:`watch`."""

    allowed: tuple[str, ...] = ()
    allowed_prefixes: tuple[str, ...] = ()
    outside: list[tuple[str, str]] = field(default_factory=list)
    active: bool = False

    @staticmethod
    def _library_roots() -> tuple[str, ...]:
        roots = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, "/proc", "/sys", "/dev/null"}
        roots.update(p for p in sys.path if p and os.path.isdir(p) and p != os.getcwd())
        # the repository: its modules and its package metadata (the manifest records versions)
        roots.add(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        # never a root that holds the temporary directories the cases live in (e.g. "/" on sys.path)
        tmp = os.path.realpath(tempfile.gettempdir())
        real = {os.path.realpath(r) for r in roots}
        return tuple(r for r in real if not (tmp == r or tmp.startswith(r.rstrip(os.sep) + os.sep)))

    def _ok(self, path: str) -> bool:
        p = os.path.abspath(path)
        for root in self.allowed:
            if p == root or p.startswith(root + os.sep):
                return True
        parent = os.path.dirname(self.allowed[-1])
        if p == parent:  # opened to fsync the directory entry of the destination
            return True
        if p.startswith(parent + os.sep):  # inside a temporary sibling of the destination
            first = os.path.relpath(p, parent).split(os.sep)[0]
            if any(first.startswith(prefix) for prefix in self.allowed_prefixes):
                return True
        rp = os.path.realpath(p)
        return any(rp == r or rp.startswith(r + os.sep) for r in _LIBRARY_ROOTS)

    def hook(self, event: str, args: tuple[Any, ...]) -> None:
        if not self.active or event not in _PATH_EVENTS:
            return
        for i in _PATH_EVENTS[event]:
            if i < len(args) and isinstance(args[i], (str, bytes, os.PathLike)):
                path = os.fsdecode(args[i])
                if not self._ok(path):
                    self.outside.append((event, path))

    @contextlib.contextmanager
    def watch(self, hf_dir: str, destination: str) -> Iterator["Audit"]:
        """Audit the block: allowed are ``hf_dir``, ``destination``, its temporary siblings
        ``.<name>.*`` and the writer lock of its parent."""
        dest = os.path.abspath(destination)
        self.allowed = (os.path.abspath(hf_dir), os.path.join(os.path.dirname(dest), LOCK_NAME), dest)
        self.allowed_prefixes = (f".{os.path.basename(dest)}.",)
        _install(self)
        self.active = True
        try:
            yield self
        finally:
            self.active = False


_LIBRARY_ROOTS: tuple[str, ...] = Audit._library_roots()
_HOOKED: list[Audit] = []


def _install(audit: Audit) -> None:
    if not _HOOKED:
        sys.addaudithook(lambda event, args: _HOOKED[0].hook(event, args) if _HOOKED[0] is not None else None)
        _HOOKED.append(audit)
    _HOOKED[0] = audit


@dataclass
class Outcome:
    """How one hostile case ended."""

    error: BaseException | None
    seconds: float
    hung: bool
    outside: list[tuple[str, str]]


def run_guarded(fn: Any, hf_dir: str, destination: str, *, limit: float = 20.0) -> Outcome:
    """Run ``fn()`` under the time limit, the FIFO watchdog and the audit; the outcome says how
    it ended. Never raises (except KeyboardInterrupt)."""
    audit = Audit()
    start = time.perf_counter()
    error: BaseException | None = None
    hung = False
    with FifoWatchdog(hf_dir, after=min(5.0, limit / 2)) as dog:
        try:
            with audit.watch(hf_dir, destination), deadline(limit):
                fn()
        except Hang as e:
            error, hung = e, True
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # noqa: BLE001 - the caller judges it
            error = e
    return Outcome(error, time.perf_counter() - start, hung or dog.fired, list(audit.outside))
