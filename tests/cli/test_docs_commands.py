"""The commands README.md and docs/ show use options that exist: a renamed or removed option of
``mfsdp-ckpt`` or of the trainer fails here, not when a reader pastes the command.

Only the options are checked (running every documented command takes minutes of training; the
commands were run by hand when the docs last changed)."""

from __future__ import annotations

import contextlib
import re
import shlex
from pathlib import Path

from cli import train
from cli.main import main as ckpt_main

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_BLOCK = re.compile(r"^```(?:bash|sh|console)\n(.*?)^```", re.S | re.M)
ENDS_A_COMMAND = {"&&", "||", "|", ";", ">", "2>&1"}


def _commands(text: str) -> list[list[str]]:
    """Every command line of the document's shell blocks, continuation lines joined and comments
    dropped, as shell words; a line shlex cannot split (a heredoc body) is skipped."""
    out = []
    for block in SHELL_BLOCK.findall(text):
        for line in block.replace("\\\n", " ").splitlines():
            with contextlib.suppress(ValueError):
                words = shlex.split(line, comments=True)
                current: list[str] = []
                for word in words:
                    if word in ENDS_A_COMMAND:
                        out.append(current)
                        current = []
                    else:
                        current.append(word)
                out.append(current)
    return [c for c in out if c]


def _options_after(words: list[str], start: int) -> list[str]:
    return [w.split("=", 1)[0] for w in words[start:] if w.startswith("--")]


def _ckpt_options(command: str) -> set[str]:
    params = ckpt_main.commands[command].params
    return {o for p in params for o in (*p.opts, *p.secondary_opts) if o.startswith("--")} | {"--help"}


def _trainer_options() -> set[str]:
    return set(train.build_parser()._option_string_actions)


def _documented() -> list[tuple[str, list[str]]]:
    return [(doc.relative_to(ROOT).as_posix(), words) for doc in DOCUMENTS for words in _commands(doc.read_text())]


def test_the_documents_show_commands_of_both_programs():
    """The scan finds what it checks (an empty scan would pass anything)."""
    words = [w for _, c in _documented() for w in c]
    assert sum(w.endswith("mfsdp-ckpt") for w in words) > 30
    assert sum(w == "cli.train" or w.endswith("mfsdp-train") for w in words) > 5  # the trainer, either way


def test_every_documented_mfsdp_ckpt_option_exists():
    top = {o for p in ckpt_main.params for o in p.opts} | {"--help", "--version"}
    wrong = []
    for doc, words in _documented():
        for i, word in enumerate(words):
            if not word.endswith("mfsdp-ckpt"):
                continue
            rest = words[i + 1 :]
            command = next((w for w in rest if not w.startswith("-")), None)
            if command is None:  # `mfsdp-ckpt --help`, `--version`
                continue
            if command not in ckpt_main.commands:
                wrong.append(f"{doc}: unknown command {command!r} in {' '.join(words)}")
                continue
            at = rest.index(command)
            wrong += [f"{doc}: {o} in {' '.join(words)}" for o in _options_after(rest[:at], 0) if o not in top]
            known = _ckpt_options(command)
            wrong += [f"{doc}: {o} in {' '.join(words)}" for o in _options_after(rest, at + 1) if o not in known]
    assert not wrong, "\n".join(wrong)


def test_every_documented_trainer_option_exists():
    known = _trainer_options()
    assert {"--ckpt-dir", "--resume", "--steps", "-h"} <= known
    wrong = []
    for doc, words in _documented():
        for i, word in enumerate(words):
            if (word == "cli.train" and words[i - 1] == "-m") or word.endswith("mfsdp-train"):
                wrong += [f"{doc}: {o} in {' '.join(words)}" for o in _options_after(words, i + 1) if o not in known]
    assert not wrong, "\n".join(wrong)


def test_the_scan_joins_continuation_lines_and_drops_comments():
    """A command split over lines is checked whole; a comment's words are not options."""
    words = _commands("```bash\n.venv/bin/mfsdp-ckpt verify ckpt --no-such-flag \\\n  --json  # a comment\n```\n")
    assert words == [[".venv/bin/mfsdp-ckpt", "verify", "ckpt", "--no-such-flag", "--json"]]
    assert _options_after(words[0], 3) == ["--no-such-flag", "--json"]
