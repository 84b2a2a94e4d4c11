"""The trainer's settings from a TOML file (``--config``), and from the checkpoint a run resumes.

Precedence, highest first: the command line, the ``--config`` file, the settings the resumed
checkpoint recorded (``--resume`` continues a run with the settings it had), the built-in defaults.

A config file sets any flag by its name, without the dashes (``batch-size`` or ``batch_size``),
either at the top level or in the section that ``mfsdp-train --help`` lists it under, as
torchtitan's job files group theirs::

    [model]
    model = "tiny-moe"
    [training]
    steps = 60
    batch-size = 12
    [checkpoint]
    ckpt-dir = "ckpts/run1"
    save-every = 10

A switch takes ``true`` / ``false``, a repeatable flag a list. Each entry is checked as its flag
would be, and a bad one is refused in one line naming the file, the section and the key.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from .train_launch import LAUNCH_DESTS

__all__ = ["ConfigError", "config_argv", "resolved_settings", "NOT_CARRIED"]

# settings of one invocation, not of the run: never taken from a resumed checkpoint
NOT_CARRIED = frozenset(
    {
        "config",
        "resume",
        "init_from",
        "allow_change",
        "ckpt_dir",
        "stop_at",
        "model",
        "model_config",
        "hf_model",
        "mcore_config",
        "lora",  # the checkpoint's model_source records it, with the model
        # the layout is the job's: it follows the world size, and a checkpoint loads into any
        "ep",
        "dp_replicate",
        "hfsdp",
        "node_size",
        *LAUNCH_DESTS,  # how this job was started
    }
)
_NOT_IN_FILES = frozenset({"help", "version", "config"})


class ConfigError(ValueError):
    """A config file that cannot be read or sets something wrongly (one line, naming it)."""


def _settable(parser: argparse.ArgumentParser) -> dict[str, tuple[str, argparse.Action]]:
    """``name -> (section, action)`` for every flag a file may set (both dash and underscore names)."""
    out: dict[str, tuple[str, argparse.Action]] = {}
    for group in parser._action_groups:
        for action in group._group_actions:
            longs = [o for o in action.option_strings if o.startswith("--")]
            if not longs or action.dest in _NOT_IN_FILES:
                continue
            for option in longs:
                name = option[2:]
                out[name] = out[name.replace("-", "_")] = (group.title or "", action)
    return out


def config_argv(path: str, parser: argparse.ArgumentParser, check: argparse.ArgumentParser) -> list[str]:
    """The file's settings as command-line words (put before the real ones, which then win).
    ``check`` is a parser whose ``error`` raises: each entry is parsed alone with it."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"--config {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--config {path}: not valid TOML: {e}") from None
    settable = _settable(parser)
    sections = {section for section, _ in settable.values()}
    words: list[str] = []
    for key, value in data.items():
        if isinstance(value, dict):
            if key not in sections:
                raise ConfigError(f"{path}: [{key}]: not a section{_suggest(key, sections)}")
            for name, inner in value.items():
                words += _entry(path, f"[{key}] {name}", name, inner, key, settable, check)
        else:
            words += _entry(path, key, key, value, None, settable, check)
    return words


def _entry(
    path: str,
    where: str,
    name: str,
    value: Any,
    section: str | None,
    settable: dict[str, tuple[str, argparse.Action]],
    check: argparse.ArgumentParser,
) -> list[str]:
    """The words of one entry, after parsing them alone (a wrong value fails here, named)."""
    if name not in settable:
        raise ConfigError(f"{path}: {where}: not a trainer setting{_suggest(name, settable)}")
    home, action = settable[name]
    if section is not None and section != home:
        raise ConfigError(f"{path}: {where}: belongs in [{home}]")
    words = _words(action, value)
    if words is None:
        raise ConfigError(f"{path}: {where} = {value!r}: {_expected(action)}")
    try:
        check.parse_args(words)
    except ConfigError as e:
        raise ConfigError(f"{path}: {where} = {value!r}: {e}") from None
    return words


def _words(action: argparse.Action, value: Any) -> list[str] | None:
    """``value`` as the words that set ``action`` on a command line; None if it cannot be."""
    option = max(action.option_strings, key=len)
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        if not isinstance(value, bool):
            return None
        return [option] if value != action.default else []
    if isinstance(action, argparse._AppendAction):
        values = value if isinstance(value, list) else [value]
        if any(isinstance(v, (bool, list, dict)) for v in values):
            return None
        return [f"{option}={v}" for v in values]
    if action.nargs == "?" and isinstance(value, bool):
        return [option] if value else []
    if isinstance(value, (bool, list, dict)):
        return None
    return [f"{option}={value}"]


def _expected(action: argparse.Action) -> str:
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return "expected true or false"
    if isinstance(action, argparse._AppendAction):
        return "expected a string or a list of strings"
    if action.nargs == "?":
        return "expected true, false or a value"
    return "expected one value (a string or a number)"


def _suggest(name: str, known: Any) -> str:
    close = difflib.get_close_matches(name, list(known), n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def resolved_settings(values: dict[str, Any]) -> dict[str, Any]:
    """Every setting of this run that a resumed run takes as its default (``NOT_CARRIED`` apart),
    by flag attribute (``values``: ``Settings.values()``): what the checkpoint records so that
    ``--resume`` needs no flags repeated."""
    return {
        dest: value
        for dest, value in sorted(values.items())
        if dest not in NOT_CARRIED and not dest.startswith("_") and _jsonable(value)
    }


def _jsonable(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_jsonable(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str))
