"""``mfsdp-ckpt``: the command line. It parses, calls the Python API, and prints; errors are one
line on stderr with exit code 1 (usage errors: 2). Each command first makes the refusals its
arguments and local paths decide (a missing input, an existing destination, a bad flag value), in
the library's words, and only then imports torch (about 2 s): ``--help`` and those refusals answer
at once (``tests/cli/test_ckpt_cli_fast_refusals.py``)."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Callable


def _exit_on_escaped_interrupt() -> None:
    """From now on a ``KeyboardInterrupt`` that escapes every handler (one raised while this
    module's imports below run, before the command line takes SIGINT) ends the process as the
    command line does (``error: interrupted``, said by process 0 of a torchrun job only; 130),
    not with a traceback of the import machinery. Installed first thing, before click's import:
    what remains before it is the interpreter's own start-up."""
    previous = sys.excepthook

    def excepthook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        if not issubclass(kind, KeyboardInterrupt):
            previous(kind, value, tb)
            return
        try:
            if os.environ.get("RANK", "0") == "0":
                print("error: interrupted", file=sys.stderr)
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(130)

    sys.excepthook = excepthook


_exit_on_escaped_interrupt()

import click  # noqa: E402

from .common import (  # noqa: E402
    CAST_CHOICES,
    _as_json,
    _human,
    _run,
    _run_with_progress,
    check_key_map,
    check_size,
    is_local,
    refuse_any_output,
    refuse_existing_output,
    refuse_missing_checkpoint,
    refuse_output_among_inputs,
    refuse_unlistable,
    settle,
)
from .interrupt import InterruptibleGroup  # noqa: E402
from .job import begin, one_process, run_offline  # noqa: E402

#: ``reshard --world-size``'s bound, :data:`mfsdp_ckpt.sharded.reshard.MAX_WORLD_SIZE` (which imports torch)
MAX_WORLD_SIZE = 1 << 16


@click.group(cls=InterruptibleGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 120})
@click.version_option(package_name="mfsdp-ckpt", prog_name="mfsdp-ckpt", message="%(prog)s %(version)s")
@click.option("--debug", is_flag=True, help="show the traceback of an error instead of one line")
def main(debug: bool) -> None:
    """Inspect, verify, compare, list, reshard and convert mfsdp and PyTorch DCP checkpoints, and
    bridge them to Hugging Face safetensors. Run `mfsdp-ckpt COMMAND --help` for a command's options."""


@main.command(short_help="Show a checkpoint's format, step, layout, config and tensors.")
@click.argument("path")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@click.option("--html", "html_out", default=None, metavar="OUT.html", help="also write a page drawing the layout")
@click.option("--png", "png_out", default=None, metavar="OUT.png", help="also write a screenshot of that page")
def inspect(path: str, as_json: bool, html_out: str | None, png_out: str | None) -> None:
    """Format, step, writer layout, model config and the tensors of the checkpoint at PATH.
    --html draws, per tensor group, a strip per rank of what it wrote and where in which file."""
    _check_report_outputs([path], html_out, png_out)
    begin(lambda: refuse_missing_checkpoint(path))
    if html_out or png_out:
        _write_report(lambda out: _inspect_html(path, out), html_out, png_out)
        return
    from mfsdp_ckpt.errors import shown_list
    from mfsdp_ckpt.tools import GROUPS, compact_ranges, describe_source, inspect_checkpoint

    info = _run(lambda: inspect_checkpoint(path))
    settle()  # what follows reports it: a Ctrl-C no longer changes the outcome
    if as_json:
        click.echo(json.dumps(info.to_json(), indent=1))
        return
    click.echo(f"checkpoint  {info.path}")
    click.echo(f"format      {info.format}{'' if info.committed else ' (no mfsdp.json)'}")
    click.echo(f"step        {info.step if info.step is not None else 'unknown'}")
    if info.writer:
        layouts = ", ".join(
            f"{b['strategy']}/{b['policy']} over {b['group_size']}"
            + (f" ({b['group']})" if b.get("group", "dp") != "dp" else "")
            for b in info.writer.get("buffers", [])
        )
        click.echo(f"writer      world size {info.writer.get('world_size')}" + (f"; {layouts}" if layouts else ""))
    if info.experts:
        x = info.experts
        click.echo(f"experts     EP size {x.ep_size}, {x.num_experts} experts")
        for p, (ranks, experts) in enumerate(zip(x.ranks, x.experts)):
            shown = shown_list(ranks, 8)
            click.echo(f"  EP rank {p}: ranks {shown}; experts {compact_ranges(experts)}")
    if info.mx:
        formats = sorted({m.format for m in info.mx})
        click.echo(f"mx          {len(info.mx)} MXFP8 tensor(s), {', '.join(formats)}, 32-element blocks")
        for m in info.mx:
            click.echo(f"  {m.fqn} {'x'.join(map(str, m.shape))} {m.format}: {', '.join(m.planes)}")
    click.echo(f"source      {describe_source(info.model_source)}")
    if info.base:
        click.echo(
            f"base        {info.base['name']}: {info.base['entries']} frozen weight(s) written once, read from there"
        )
    if info.model_config:
        click.echo(f"model       {json.dumps(info.model_config)}")
    elif (info.model_source or {}).get("kind") == "transformers":
        click.echo("model       the source's config.json (inspect --json: model_source.config)")
    else:
        click.echo("model       unknown")
    if info.unknown:
        click.echo(f"unknown     {', '.join(info.unknown)}")
    for group in (*GROUPS, "other"):
        rows = [t for t in info.tensors if t.group == group]
        if not rows:
            continue
        click.echo(f"\n[{group}]")
        width = max(len(t.key) for t in rows)
        for t in rows:
            shape = "object" if t.shape is None else "x".join(map(str, t.shape)) or "scalar"
            click.echo(
                f"  {t.key:<{width}}  {t.dtype or '-':<9} {shape:<14} {_human(t.bytes):>10}  {t.chunks} chunk(s)"
            )
    click.echo("")
    for group, total in info.totals().items():
        click.echo(f"total {group:<6} {total['tensors']:5d} entries {_human(total['bytes']):>10}")


def _inspect_html(path: str, out: str) -> str:
    from mfsdp_ckpt.tools import inspect_html

    return inspect_html(path, out)


def _diff_html(a: str, b: str, result: object, out: str) -> str:
    from mfsdp_ckpt.tools import diff_html

    return diff_html(a, b, result, out)  # type: ignore[arg-type]


def _check_report_outputs(inputs: list[str], html_out: str | None, png_out: str | None) -> None:
    """Refuse, before anything is read, a ``--html`` or ``--png`` file that would write over, into
    or around a checkpoint the command reads (its manifest, a data file, the ``latest`` pointer,
    its directory), that is not a regular file (a directory, a link, a FIFO), or the two the same."""
    if not (html_out or png_out):
        return
    from mfsdp_ckpt.errors import CheckpointError
    from mfsdp_ckpt.tools import check_report_out, overlap

    def check() -> None:
        for flag, out in (("--html", html_out), ("--png", png_out)):
            if out:
                check_report_out(out, inputs, flag)
        if html_out and png_out and overlap(png_out, html_out):
            raise CheckpointError(f"--png {png_out}: is the --html file; give the screenshot another name")

    _run(check)


def _write_report(render: Callable[[str], str], html_out: str | None, png_out: str | None) -> None:
    """Write the page to ``html_out`` (a temporary file when only ``png_out`` is asked for) and
    its screenshot to ``png_out``; one line per file written."""
    import os
    import tempfile

    def run() -> list[str]:
        from mfsdp_ckpt.tools import find_browser, screenshot

        if png_out:
            find_browser()  # before any work: say what is missing first
        with tempfile.TemporaryDirectory(prefix="mfsdp-report-") as tmp:
            page = render(html_out or os.path.join(tmp, "report.html"))
            return [*([page] if html_out else []), *([screenshot(page, png_out)] if png_out else [])]

    for written in _run(run):
        click.echo(f"wrote {written}", err=_as_json())  # stdout stays one JSON document under --json


def _resolved(path: str) -> str:
    """The checkpoint directory ``path`` names, as ``--json``'s ``path`` gives it: a ``latest``
    pointer (or a run directory holding one) resolved to the checkpoint it points at."""
    from mfsdp_ckpt import resolve_checkpoint
    from mfsdp_ckpt.errors import CheckpointError
    from mfsdp_ckpt.tools import normalize

    try:
        return resolve_checkpoint(path)
    except CheckpointError:  # a file the command took as it is (an MCore directory, say)
        return normalize(path)


@main.command(short_help="Check that every tensor is covered once and every chunk matches its checksum.")
@click.argument("path")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def verify(path: str, as_json: bool) -> None:
    """Check every tensor is covered exactly once and every chunk's bytes match their checksum.
    Exit 0 only if all holds; otherwise list each fault (file, key, offset)."""
    begin(lambda: refuse_missing_checkpoint(path))
    from mfsdp_ckpt.tools import verify_checkpoint

    start = time.perf_counter()
    faults = _run_with_progress("verify", lambda bar: verify_checkpoint(path, progress=bar))
    settle()
    if as_json:
        click.echo(
            json.dumps(
                {
                    "path": _resolved(path),
                    "seconds": time.perf_counter() - start,
                    "ok": not faults,
                    "faults": [f.__dict__ for f in faults],
                    "notes": list(getattr(faults, "notes", [])),
                },
                indent=1,
            )
        )
        sys.exit(1 if faults else 0)
    for note in getattr(faults, "notes", []):
        click.echo(f"NOTE {note}")
    if faults:
        for fault in faults:
            click.echo(f"FAULT {fault}")
        click.echo(f"{len(faults)} fault(s)")
    else:
        click.echo(f"ok: {path}")
    sys.exit(1 if faults else 0)


@main.command(short_help="Compare two checkpoints tensor by tensor, whatever their layouts.")
@click.argument("a")
@click.argument("b")
@click.option("--atol", type=float, default=0.0, show_default=True, help="absolute tolerance")
@click.option("--rtol", type=float, default=0.0, show_default=True, help="relative tolerance")
@click.option(
    "--key-map-a",
    "key_map_a",
    multiple=True,
    metavar="OLD=NEW",
    help="rename A's key prefix OLD to NEW before comparing (repeatable; '=model.' for bare model names alone)",
)
@click.option("--key-map-b", "key_map_b", multiple=True, metavar="OLD=NEW", help="the same for B")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@click.option("--html", "html_out", default=None, metavar="OUT.html", help="also write a page of the differences")
@click.option("--png", "png_out", default=None, metavar="OUT.png", help="also write a screenshot of that page")
def diff(
    a: str,
    b: str,
    atol: float,
    rtol: float,
    key_map_a: tuple[str, ...],
    key_map_b: tuple[str, ...],
    as_json: bool,
    html_out: str | None,
    png_out: str | None,
) -> None:
    """Compare checkpoints A and B logically, whatever their layouts; exit 1 when they differ.
    Entries are matched by canonical name: a stock DCP checkpoint (FSDP2, torchtitan, dcp.save)
    is read through its key layout. (Per-rank RNG states are not compared: they depend on the
    world size.)"""
    start = time.perf_counter()
    _check_report_outputs([a, b], html_out, png_out)  # before the comparison (and torch): at once
    begin(lambda: _check_diff(a, b, key_map_a, key_map_b))
    from mfsdp_ckpt.tools import diff_checkpoints

    result = _run_with_progress(
        "diff",
        lambda bar: diff_checkpoints(
            a, b, atol=atol, rtol=rtol, progress=bar, key_map_a=key_map_a, key_map_b=key_map_b
        ),
        unit="entries",
    )
    if html_out or png_out:
        _write_report(lambda out: _diff_html(a, b, result, out), html_out, png_out)
    settle()
    if as_json:  # "ok" as verify has it; "equal" is the same flag under its earlier name (deprecated)
        seconds = time.perf_counter() - start
        doc = {"a": _resolved(a), "b": _resolved(b), "ok": result.equal, **result.to_json(), "seconds": seconds}
        click.echo(json.dumps(doc, indent=1))
    else:
        for key in result.only_in_a:
            click.echo(f"only in A  {key}")
        for key in result.only_in_b:
            click.echo(f"only in B  {key}")
        for d in result.different:
            click.echo(f"{d.problem:<10} {d.key}: {d.detail}")
        n = result.counts
        click.echo(
            f"{'equal' if result.equal else 'different'}: {n['equal']} equal, {n['different']} different, "
            f"{n['only_in_a']} only in A, {n['only_in_b']} only in B; {result.compared} common entries compared"
        )
    sys.exit(0 if result.equal else 1)


def _check_diff(a: str, b: str, key_map_a: tuple[str, ...], key_map_b: tuple[str, ...]) -> None:
    """``diff``'s refusals before torch, in the order :func:`mfsdp_ckpt.tools.diff.diff_checkpoints`
    makes them: the key maps, then A and B."""
    check_key_map(key_map_a)
    check_key_map(key_map_b)
    refuse_missing_checkpoint(a)
    refuse_missing_checkpoint(b)


@main.command(short_help="Convert between a checkpoint and one .pt or .safetensors file, or FSDP2's key layout.")
@click.argument("src")
@click.argument("dst")
@click.option(
    "--to",
    "to",
    type=click.Choice(["torch", "safetensors", "dcp", "dcp-fsdp2", "torchtitan"]),
    required=True,
    help="torch / safetensors: one file from a DCP checkpoint; dcp: a checkpoint from a .pt or .safetensors file; "
    "dcp-fsdp2: a DCP checkpoint in the key layout of FSDP2's get_state_dict (for set_state_dict); "
    "torchtitan: a DCP checkpoint in torchtitan's layout at the source's world size (reshard --to torchtitan)",
)
@click.option(
    "--key-map",
    "key_map",
    multiple=True,
    metavar="OLD=NEW",
    help="with --to dcp-fsdp2: rename the output keys' prefix OLD to NEW (repeatable, first match wins), "
    "e.g. 'model.=' for bare model names",
)
@click.option(
    "--max-file-size",
    default="5GB",
    show_default=True,
    help="with --to dcp-fsdp2: the largest data file (5GB, 500MB, 2GiB, bytes); the next entry starts a new "
    "one, so that the processes of a torchrun job can share the files out",
)
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def convert(src: str, dst: str, to: str, key_map: tuple[str, ...], max_file_size: str, as_json: bool) -> None:
    """Convert SRC to DST (which must not exist): full tensors, canonical keys (dcp-fsdp2: FSDP2's keys)."""
    begin(lambda: _check_convert(src, dst, to, key_map, max_file_size), output=dst)
    from mfsdp_ckpt.tools import convert as run_convert
    from mfsdp_ckpt.tools import normalize

    start = time.perf_counter()
    out = run_offline(
        "read",
        lambda bar: run_convert(src, dst, to, progress=bar, key_map=key_map, max_file_size=max_file_size),
        unit="entries",
    )
    doc = {"path": normalize(out), "format": to, "seconds": time.perf_counter() - start}
    click.echo(json.dumps(doc, indent=1) if as_json else f"wrote {out}")


def _check_convert(src: str, dst: str, to: str, key_map: tuple[str, ...], max_file_size: str) -> None:
    """``convert``'s refusals before torch, as :func:`mfsdp_ckpt.tools.convert.convert` makes them
    (the same checks, in its order; with an object store on either side, the key map only)."""
    from mfsdp_ckpt.errors import CheckpointError, NotACheckpointError
    from mfsdp_ckpt.tools import normalize

    src, dst = normalize(src), normalize(dst)
    if check_key_map(key_map) and to != "dcp-fsdp2":
        raise CheckpointError(f"--key-map: applies to --to dcp-fsdp2 only, not --to {to}")
    if not (is_local(src) and is_local(dst)):
        return
    refuse_any_output(dst, src, kind="file" if to in ("torch", "safetensors") else "checkpoint")
    if to == "dcp" and not os.path.isfile(src):
        raise NotACheckpointError(f"{src}: not a file (convert --to dcp reads a .pt or .safetensors file)")
    if to != "dcp":
        refuse_missing_checkpoint(src)
    if to == "dcp-fsdp2":
        check_size(max_file_size, "--max-file-size")


@main.command(short_help="Rewrite a checkpoint for another world size, strategy, policy or EP size.")
@click.argument("src")
@click.argument("dst")
@click.option("--world-size", type=int, required=True, help="ranks of the target job")
@click.option(
    "--ep",
    type=int,
    default=None,
    help="expert-parallel size of the target job (default: the writer's; 1 without expert parallelism)",
)
@click.option(
    "--strategy", default=None, help="no_shard, optim, optim_grads or optim_grads_params (default: the writer's)"
)
@click.option("--policy", default=None, help="even, row, block(N) or tensor (default: the writer's)")
@click.option(
    "--plan-from",
    default=None,
    metavar="CKPT",
    help="take the placement plan from CKPT (a checkpoint of the same model), for a SRC that records none",
)
@click.option("--model-only", is_flag=True, help="drop optimizer and gradient state")
@click.option("--dtype", type=click.Choice(CAST_CHOICES), default=None, help="cast the model weights")
@click.option(
    "--workers",
    type=int,
    default=None,
    help="threads writing target files in parallel (default: one per target file, at most 2 per CPU and 4; "
    "never more than the target files)",
)
@click.option(
    "--key-map",
    "key_map",
    multiple=True,
    metavar="OLD=NEW",
    help="rename the key prefix OLD to NEW before anything else (repeatable, first match wins): "
    "'=model.' adds 'model.' (bare model names alone; a torchtitan checkpoint needs none), 'model.=' strips it",
)
@click.option(
    "--to",
    "to",
    type=click.Choice(["mfsdp", "torchtitan"]),
    default="mfsdp",
    show_default=True,
    help="the key layout written: mfsdp (canonical keys) or torchtitan (its CheckpointManager's names, every "
    "tensor's rows as FSDP2 shards them over the ranks; torchtitan's load reads it)",
)
@click.option("--overwrite", is_flag=True, help="replace DST if it exists")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def reshard(
    src: str,
    dst: str,
    world_size: int,
    ep: int | None,
    strategy: str | None,
    policy: str | None,
    plan_from: str | None,
    model_only: bool,
    dtype: str | None,
    workers: int | None,
    key_map: tuple[str, ...],
    to: str,
    overwrite: bool,
    as_json: bool,
) -> None:
    """Rewrite checkpoint SRC as DST for a target layout: one data file per target rank holding
    exactly what that rank reads. Streams one tensor range at a time (bounded memory). SRC may be
    a stock DCP checkpoint (FSDP2 get_state_dict, torchtitan, any dcp.save): DST is then a
    committed canonical checkpoint, or with --to torchtitan one torchtitan's load reads."""
    flags = dict(
        world_size=world_size, ep=ep, strategy=strategy, policy=policy, workers=workers, key_map=key_map, to=to
    )
    begin(lambda: _check_reshard(src, dst, plan_from, overwrite, **flags), output=dst)
    from mfsdp_ckpt.tools import reshard as run_reshard

    start = time.perf_counter()
    result = run_offline(
        "reshard",
        lambda bar: run_reshard(
            src,
            dst,
            world_size=world_size,
            ep=ep,
            strategy=strategy,
            policy=policy,
            plan_from=plan_from,
            model_only=model_only,
            dtype=dtype,
            workers=workers,
            overwrite=overwrite,
            key_map=key_map,
            progress=bar,
            to=to,
        ),
    )
    seconds = time.perf_counter() - start
    if as_json:
        click.echo(json.dumps({**result.to_json(), "seconds": seconds}, indent=1))
        return
    click.echo(
        f"wrote {result.path}: {result.keys} entries, {_human(result.bytes_written)} of data files in {result.files} "
        f"file(s) for world size {result.world_size}"
        + (f", EP size {result.ep_size}" if result.ep_size else "")
        + f", {seconds:.1f} s"
    )
    if result.dropped:
        from mfsdp_ckpt.errors import shown_list

        click.echo(f"dropped {len(result.dropped)} entries ({shown_list(result.dropped, 4)})")


def _check_reshard(src: str, dst: str, plan_from: str | None, overwrite: bool, **flags: Any) -> None:
    """``reshard``'s refusals before torch, as :func:`mfsdp_ckpt.sharded.reshard.reshard` makes
    them, in its order: ``--plan-from`` apart from DST, the flags, the key map, SRC and the
    ``--plan-from`` checkpoint, ``--ep``, DST."""
    from mfsdp_ckpt.errors import CheckpointError

    refuse_output_among_inputs(dst, "the --plan-from checkpoint", plan_from)
    _check_reshard_flags(flags["world_size"], flags["workers"], flags["strategy"], flags["policy"])
    if flags["to"] == "torchtitan":  # its layout is FSDP2's, fixed by the world size
        given = dict(strategy=flags["strategy"], policy=flags["policy"], ep=flags["ep"], plan_from=plan_from)
        for name, value in given.items():
            if value is not None:
                flag = "--" + name.replace("_", "-")
                raise CheckpointError(
                    f"{flag}: does not apply to --to torchtitan (FSDP2's layout: every tensor's rows over the ranks)"
                )
    check_key_map(flags["key_map"])
    refuse_missing_checkpoint(src)
    refuse_missing_checkpoint(plan_from)
    if flags["ep"] is not None and flags["ep"] < 1:
        raise CheckpointError(f"--ep must be >= 1, got {flags['ep']}")
    refuse_existing_output(dst, overwrite=overwrite)


def _check_reshard_flags(world_size: int, workers: int | None, strategy: str | None, policy: str | None) -> None:
    """The refusals of ``reshard``'s flags, in its words (``_check_arguments`` of
    :mod:`mfsdp_ckpt.sharded.reshard`; the strategy and policy parsers import no torch)."""
    from mfsdp_ckpt.errors import CheckpointError
    from mfsdp_core.policy import parse_policy
    from mfsdp_core.strategy import parse_strategy

    if world_size < 1:
        raise CheckpointError(f"--world-size must be >= 1, got {world_size}")
    if world_size > MAX_WORLD_SIZE:
        raise CheckpointError(f"--world-size must be <= {MAX_WORLD_SIZE}, got {world_size}")
    if workers is not None and workers < 1:
        raise CheckpointError(f"--workers must be >= 1, got {workers}")
    for flag, value, parse in (("--strategy", strategy, parse_strategy), ("--policy", policy, parse_policy)):
        try:
            if value is not None:
                parse(value)
        except ValueError as e:
            raise CheckpointError(f"{flag}: {e}") from None


@main.command(short_help="Make an MoE checkpoint whose experts are copies of a dense checkpoint's MLP (upcycling).")
@click.argument("src")
@click.argument("dst")
@click.option("--num-experts", type=int, required=True, help="experts per layer (E >= 1)")
@click.option("--topk", type=int, required=True, help="experts each token is routed to (K in [1, E])")
@click.option(
    "--granularity",
    type=int,
    default=1,
    show_default=True,
    help="each expert holds one of G slices of the dense FFN (G divides E, K and the FFN size)",
)
@click.option("--seed", type=int, default=0, show_default=True, help="seed of the routers' random initialisation")
@click.option("--overwrite", is_flag=True, help="replace DST if it exists")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def upcycle(
    src: str,
    dst: str,
    num_experts: int,
    topk: int,
    granularity: int,
    seed: int,
    overwrite: bool,
    as_json: bool,
) -> None:
    """Write the dense checkpoint SRC as an MoE checkpoint DST that computes the same function:
    every expert a copy of the dense MLP (or one of G slices of it), softmax top-K routing
    renormalised, routers drawn at random (seeded). Weights only: the optimizer state is
    dropped; train from DST with mfsdp-train --init-from DST."""
    begin(lambda: _check_upcycle(src, dst, num_experts, topk, granularity, overwrite), output=dst)
    from mfsdp_ckpt.tools import upcycle as run_upcycle

    result = run_offline(
        "upcycle",
        lambda bar: (
            one_process("upcycle")
            or run_upcycle(
                src,
                dst,
                num_experts=num_experts,
                topk=topk,
                granularity=granularity,
                seed=seed,
                overwrite=overwrite,
                progress=bar,
            )
        ),
    )
    if as_json:
        click.echo(json.dumps(result.to_json(), indent=1))
        return
    granular = f", granularity {granularity}" if granularity != 1 else ""
    click.echo(
        f"wrote {result.path}: {num_experts} experts, top-{topk}{granular}, {result.tensors} tensors, "
        f"{_human(result.bytes)} of data files, {result.seconds:.1f} s"
    )


def _check_upcycle(src: str, dst: str, num_experts: int, topk: int, granularity: int, overwrite: bool) -> None:
    """``upcycle``'s refusals before torch, as :func:`mfsdp_ckpt.tools.upcycle.upcycle` makes them
    (the spec's, naming SRC), then SRC and DST."""
    from mfsdp_ckpt.tools import UpcycleSpec, check_upcycle_spec, normalize

    check_upcycle_spec(normalize(src), UpcycleSpec(num_experts, topk, granularity))
    refuse_missing_checkpoint(src)
    refuse_existing_output(dst, overwrite=overwrite)


@main.command(name="ls", short_help="List the checkpoints under a folder, by run, and which is latest.")
@click.argument("root")
@click.option("--clean", is_flag=True, help="first remove what killed writers left behind (.partial-*, .replaced-*)")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@click.option(
    "--mem-tier",
    default=None,
    metavar="DIR",
    help="also list the memory-tier snapshots of the run ROOT (its --ckpt-dir) that this machine holds in DIR",
)
def ls(root: str, clean: bool, as_json: bool, mem_tier: str | None) -> None:
    """The checkpoints under ROOT: step, size, committed or not, latest. ROOT may be a run
    directory or a folder of runs (up to 3 levels down, ROOT's own checkpoints included): each
    run's checkpoints are then grouped under it, the run written last first. With ``--mem-tier``,
    the run's snapshots in node memory follow, by node."""
    begin(lambda: refuse_unlistable(root, mem_tier), torch=mem_tier is not None)  # ls imports torch only for the tier
    from mfsdp_ckpt.tools import clean_run_dir, list_runs
    from mfsdp_ckpt.tools import normalize as fs_normalize

    if clean:
        for path in _run(lambda: clean_run_dir(root)):
            click.echo(f"removed {path}", err=True)
    runs = _run(lambda: list_runs(root))
    snapshots = _run(lambda: _snapshots(mem_tier, root)) if mem_tier else []
    settle()
    below = not (len(runs) == 1 and runs[0][0] == fs_normalize(root))  # run dirs found under ROOT
    if as_json:  # entries gain "run" (the run directory) only when ROOT holds runs, not checkpoints
        rows = [{**e.to_json(), **({"run": run} if below else {})} for run, entries in runs for e in entries]
        rows += [{**s.to_json(), "tier": mem_tier} for s in snapshots]
        click.echo(json.dumps(rows, indent=1))
        return
    if not runs:
        click.echo(f"no checkpoints under {root}")
    for run, entries in runs:
        latest = next((e.name for e in entries if e.latest), "-")
        if below:
            click.echo(f"{run}: {len(entries)} checkpoint(s), latest {latest}")
        for e in entries:
            state = (
                "committed (base: frozen weights)"
                if e.format == "mfsdp base"
                else "committed"
                if e.committed
                else "stock DCP"
                if e.format == "stock DCP"
                else "UNCOMMITTED"
            )
            step = e.step if e.step is not None else "-"
            line = f"{e.name:<32} step {step!s:>8} {_human(e.bytes):>10}  {state}{'  <- latest' if e.latest else ''}"
            click.echo(("  " if below else "") + line)
    if mem_tier:
        click.echo(f"memory tier {mem_tier}: {len(snapshots)} snapshot(s) of this run on this machine")
    for s in snapshots:
        state = s.problem or f"{s.held} of {s.files} data files"
        click.echo(f"  node{s.node} {s.path.rsplit('/', 1)[-1]:<26} step {s.step:>8} {_human(s.bytes):>10}  {state}")


def _snapshots(mem_tier: str, root: str) -> list:
    """The memory-tier snapshots of the run ``root`` that ``mem_tier`` holds (the tier's module imports torch)."""
    from mfsdp_ckpt.tools import list_snapshots

    return list_snapshots(mem_tier, root)


from .hf import export_hf, import_hf  # noqa: E402

main.add_command(export_hf)
main.add_command(import_hf)
from .mcore import export_mcore, import_mcore  # noqa: E402

main.add_command(import_mcore)
main.add_command(export_mcore)

if __name__ == "__main__":
    main()
