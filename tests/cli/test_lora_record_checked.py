"""A LoRA checkpoint's record (``model_source.lora``) is checked against the adapters it holds
(issue 65, cause 5) by ``verify``, both exports (merged and ``--adapter``) and ``--resume``: a
record that names other targets than the adapted modules, a target with no adapter, a target
that is no module name (``../``), a rank the factors do not have, a rank of ``2**40``: each is
one line naming the checkpoint and the field, with nothing written and nothing built (it used to
be exported: PEFT dropped the unnamed adapters with a warning, or raised; ``verify`` passed it;
``--resume`` built adapters of rank ``2**40`` before checking, and blamed ``--lora``)."""

from __future__ import annotations

import json
import shutil

import pytest

from mfsdp_ckpt.errors import CheckpointError
from mfsdp_ckpt.format.manifest import manifest_checksum
from mfsdp_ckpt.hf import export, export_adapter
from mfsdp_ckpt.tools.inspect import verify_checkpoint
from tests.hf_models import make_hf_dir
from tests.reliability.surroundings import digest
from tests.torchrun import failure
from tests.warm_train import warm_train

COMMON = ("--batch-size", "4", "--seq-len", "16", "--log-every", "10")


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A 2-rank LoRA run of a small transformers Llama (adapters r=4 on q_proj and v_proj), saved at step 2."""
    tmp = tmp_path_factory.mktemp("lora-record")
    source = make_hf_dir(tmp / "src", "llama")
    ckpt = tmp / "ckpt"
    lora = ("--lora", "r=4,alpha=8,targets=q_proj,v_proj")
    run = warm_train(2, "--hf-model", source, *lora, "--steps", "2", *COMMON, "--ckpt-dir", str(ckpt))
    assert run.returncode == 0, failure(run)
    return ckpt


def _tampered(lora_run, tmp_path, **record) -> str:
    """A copy of the run whose save records ``record`` as its adapters (the manifest resealed, as a
    writer that knows the format would): the save's path."""
    run = tmp_path / "run"
    shutil.copytree(lora_run, run, symlinks=True)
    path = run / "step_000002" / "mfsdp.json"
    manifest = json.loads(path.read_text())
    manifest["model_source"]["lora"].update(record)
    manifest["manifest_crc32c"] = manifest_checksum(manifest)
    path.write_text(json.dumps(manifest))
    return str(run / "step_000002")


CASES = {
    "a-target-left-out": ({"targets": ["q_proj"]}, "'v_proj', which model_source.lora's targets (q_proj) do not name"),
    "no-such-target": ({"targets": ["zzz"]}, "'q_proj', which model_source.lora's targets (zzz) do not name"),
    "a-target-not-adapted": (
        {"targets": ["q_proj", "v_proj", "k_proj"]},
        "model_source.lora targets 'k_proj', but the checkpoint holds no adapter of it",
    ),
    "a-path-as-target": ({"targets": ["../"]}, "targets: '../' is not a module name"),
    "another-rank": ({"r": 2}, "are not factors of rank r=2"),
    "rank-2-to-the-40": ({"r": 2**40}, "field 'model_source.lora.r': 1099511627776 is outside [1, 65536]"),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_a_record_that_disagrees_with_its_adapters_is_refused_by_verify_and_both_exports(lora_run, tmp_path, case):
    record, said = CASES[case]
    save = _tampered(lora_run, tmp_path, **record)
    before = digest(tmp_path)
    for name, call in (
        ("verify", lambda: verify_checkpoint(save)),
        ("export-hf", lambda: export(save, str(tmp_path / "merged"))),
        ("export-hf --adapter", lambda: export_adapter(save, str(tmp_path / "adapter"))),
    ):
        with pytest.raises(CheckpointError) as e:
            call()
        message = str(e.value)
        assert "\n" not in message and said in message and save in message, (name, message)
    assert digest(tmp_path) == before  # nothing written


@pytest.mark.parametrize("case", ["a-target-left-out", "a-path-as-target", "rank-2-to-the-40"])
def test_resume_refuses_the_record_in_one_line_before_building_adapters(lora_run, tmp_path, case):
    record, said = CASES[case]
    save = _tampered(lora_run, tmp_path, **record)
    before = digest(tmp_path)
    run = warm_train(2, "--resume", save, "--steps", "3", *COMMON, "--allow-change", "steps")
    assert run.returncode == 1, failure(run)
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: --resume: {save}") and said in lines[0], lines
    assert "--lora" not in lines[0], lines  # nobody gave --lora
    assert digest(tmp_path) == before
