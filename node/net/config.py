"""A service's settings from four layers: flag > environment > TOML file > default.

Owns reading a service's TOML file (`--config FILE`, or `PATCHSWARM_CONFIG`),
its `PATCHSWARM_*` environment variables, and merging both under the command
line of an argparse subcommand; and `check_file`, which reports a file's
unknown keys and bad values with their line numbers. The keys are the flags
themselves, derived from the parser, so every flag a command gains (today's or
another module's) is configurable the same three ways with no list to keep:

    flag                 file key (either spelling)         environment
    --upload-limit 200M  upload-limit = "200M"              PATCHSWARM_UPLOAD_LIMIT=200M
    --no-peers           no_peers = true                    PATCHSWARM_NO_PEERS=1

Values in the file and the environment pass through the flag's own parser
(its `type` and `choices`), so they are checked exactly as on the command line.
A file may say which service it is for (`service = "node"`); it is then refused
by the others. Must not know any service's flags.

How: before parsing, every configurable flag of a layered subcommand gets a
sentinel default (and loses `required`), so after argparse the sentinel marks
exactly the flags the command line did not give; those are filled from the
environment, then the file, then the flag's real default, and the formerly
required ones are checked last.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import tomllib
from pathlib import Path

ENV_PREFIX = "PATCHSWARM_"
CONFIG_ENV = ENV_PREFIX + "CONFIG"
SERVICE_KEY = "service"
NOT_CONFIGURABLE = {"help", "version", "config"}
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


class _Unset:
    def __repr__(self) -> str:
        return "<not given>"


UNSET = _Unset()


@dataclasses.dataclass(frozen=True)
class Problem:
    """One thing wrong in a file or the environment; `line` is None where there is no line (env)."""

    where: str
    line: int | None
    message: str

    def __str__(self) -> str:
        return f"{self.where}:{self.line}: {self.message}" if self.line is not None else f"{self.where}: {self.message}"


class ConfigError(Exception):
    def __init__(self, problems: list[Problem]):
        super().__init__("; ".join(map(str, problems)))
        self.problems = problems


def add_config_argument(p: argparse.ArgumentParser) -> None:
    """Make `p` a layered command (its flags also come from a file and the environment)."""
    p.add_argument("--config", metavar="FILE", type=Path,
                   help=f"TOML file whose keys are this command's flags (also {CONFIG_ENV}); "
                        f"{ENV_PREFIX}<FLAG> variables override it, flags override both")


def is_layered(p: argparse.ArgumentParser) -> bool:
    return any(a.dest == "config" for a in p._actions)


def _options(p: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in p._actions if a.option_strings and a.dest not in NOT_CONFIGURABLE]


def _key(a: argparse.Action) -> str:
    """The file key of a flag: its longest option name without the dashes."""
    return max(a.option_strings, key=len).lstrip("-")


def env_name(a: argparse.Action) -> str:
    return ENV_PREFIX + a.dest.upper()


def _is_switch(a: argparse.Action) -> bool:
    return a.nargs == 0 and isinstance(a.const, bool)


def _is_list(a: argparse.Action) -> bool:
    return isinstance(a, argparse._AppendAction) or a.nargs in ("*", "+")


def _one(a: argparse.Action, raw) -> object:
    """One scalar through the flag's own type and choices (a TOML number goes in as its text)."""
    if isinstance(raw, bool) or not isinstance(raw, (str, int, float)):
        raise ValueError(f"expected a string or a number, found {type(raw).__name__} {raw!r}")
    text = raw if isinstance(raw, str) else str(raw)
    if a.type is None:
        value = text
    else:
        try:
            value = a.type(text)
        except (argparse.ArgumentTypeError, ValueError, TypeError) as e:
            raise ValueError(str(e) or f"invalid value {text!r}") from None
    if a.choices is not None and value not in a.choices:
        raise ValueError(f"expected one of {', '.join(map(str, a.choices))}, found {text!r}")
    return value


def convert(a: argparse.Action, raw, from_env: bool) -> object:
    """The value of flag `a` from a TOML value or an environment string; ValueError if it is not one."""
    if _is_switch(a):
        if from_env:
            word = raw.strip().lower()
            if word not in _TRUE | _FALSE:
                raise ValueError(f"expected one of 1/0, true/false, yes/no, on/off, found {raw!r}")
            on = word in _TRUE
        elif isinstance(raw, bool):
            on = raw
        else:
            raise ValueError(f"expected true or false, found {type(raw).__name__} {raw!r}")
        return a.const if on else not a.const
    if _is_list(a):
        items = [x for x in re.split(r"[,\s]+", raw) if x] if from_env else raw
        if not isinstance(items, list):
            raise ValueError(f"expected an array, found {type(raw).__name__} {raw!r}")
        return [_one(a, x) for x in items]
    return _one(a, raw)


# ---------------------------------------------------------------- the file


def key_lines(text: str) -> dict[str, int]:
    """Line number of each top-level key (first occurrence), outside multi-line strings and arrays.

    tomllib gives values without positions; a file of flags is flat, so a scan of
    its lines finds every key. A table header `[x]` is recorded as `[x`; the keys
    after it are the table's, not the top level's.
    """
    lines: dict[str, int] = {}
    in_string: str | None = None
    depth = 0
    in_table = False
    for number, line in enumerate(text.splitlines(), 1):
        rest = line
        if in_string is not None:
            if in_string not in line:
                continue
            rest = line.split(in_string, 1)[1]
            in_string = None
        elif depth == 0:
            header = re.match(r"\s*\[\[?\s*([^\]]+?)\s*\]", line)
            if header:
                lines.setdefault("[" + header.group(1).split(".")[0].strip("\"'"), number)
                in_table = True
                continue
            m = None if in_table else re.match(r"""\s*("[^"]*"|'[^']*'|[A-Za-z0-9_.-]+)\s*=(.*)""", line)
            if m:
                lines.setdefault(m.group(1).strip("\"'") if m.group(1)[0] in "\"'" else m.group(1).split(".")[0],
                                 number)
                rest = m.group(2)
        rest = re.sub(r'""".*?"""|\'\'\'.*?\'\'\'', '""', rest)
        for quote in ('"""', "'''"):
            if quote in rest:
                in_string, rest = quote, rest.split(quote)[0]
        rest = re.sub(r'"(?:[^"\\]|\\.)*"|\'[^\']*\'', '""', rest).split("#")[0]
        depth = max(0, depth + rest.count("[") - rest.count("]"))
    return lines


def read_file(path: Path) -> tuple[dict, dict[str, int]]:
    """(values, key -> line) of a TOML file; ConfigError with the parser's line if it is not TOML."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ConfigError([Problem(str(path), None, f"cannot read it: {e.strerror or e}")]) from None
    try:
        text = data.decode("utf-8")  # TOML is UTF-8, whatever the locale
    except UnicodeDecodeError as e:  # it escaped as a traceback from `config check` and every service's start
        raise ConfigError([Problem(str(path), data.count(b"\n", 0, e.start) + 1,
                                   f"not TOML: expected UTF-8 text, found byte 0x{data[e.start]:02x}")]) from None
    try:
        values = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        m = re.search(r"at line (\d+)", str(e))
        raise ConfigError([Problem(str(path), int(m.group(1)) if m else None,
                                   f"not TOML: {str(e).split(' (at line')[0]}")]) from None
    except ValueError as e:  # not a TOMLDecodeError: an integer past Python's int-from-text limit
        m = re.search(r"\d[\d_]{%d,}" % sys.get_int_max_str_digits(), text)
        raise ConfigError([Problem(str(path), text.count("\n", 0, m.start()) + 1 if m else None,
                                   f"not TOML for a service: expected integers of at most "
                                   f"{sys.get_int_max_str_digits()} digits, found a longer one" if m else
                                   f"not TOML: {e}")]) from None
    except RecursionError:  # tomllib recurses per nested array or inline table: a traceback, and on SIGHUP an exit
        raise ConfigError([Problem(str(path), _too_deep(text), f"not TOML for a service: expected arrays and inline "
                                                               f"tables nested at most {MAX_NESTING} deep, found deeper")]) from None
    return values, key_lines(text)


MAX_NESTING = 100  # what a file of flags could need is 1; Python's parser gives up near its recursion limit


def _too_deep(text: str) -> int | None:
    """The line where arrays and inline tables (strings aside) nest past MAX_NESTING, if any."""
    depth = 0
    for number, line in enumerate(text.splitlines(), 1):
        for c in re.sub(r'"(?:[^"\\]|\\.)*"|\'[^\']*\'', '""', line).split("#")[0]:
            depth += 1 if c in "[{" else -1 if c in "]}" else 0
            if depth > MAX_NESTING:
                return number
    return None


def _file_values(p: argparse.ArgumentParser, service: str, path: Path, values: dict,
                 lines: dict[str, int]) -> tuple[dict[str, object], list[Problem]]:
    """dest -> converted value for each key of a file, and what is wrong with it."""
    by_key = {}
    for a in _options(p):
        by_key[_key(a)] = a
        by_key[_key(a).replace("-", "_")] = a
    out: dict[str, object] = {}
    problems: list[Problem] = []
    where = str(path)
    for key, raw in values.items():
        line = lines.get(key) if not isinstance(raw, dict) else lines.get("[" + key, lines.get(key))
        if key == SERVICE_KEY:
            if raw != service:
                problems.append(Problem(where, line, f"{SERVICE_KEY}: this file is for {raw!r}, "
                                                     f"not for `patchswarm {service}`"))
            continue
        a = by_key.get(key)
        if a is None:
            known = ", ".join(sorted(_key(x) for x in _options(p)))
            what = "table" if isinstance(raw, dict) else "key"
            problems.append(Problem(where, line, f"{key}: unknown {what} for `patchswarm {service}` "
                                                 f"(expected top-level keys among: {known})"))
            continue
        if a.dest in out:
            problems.append(Problem(where, line, f"{key}: given twice (as {_key(a)} and {_key(a).replace('-', '_')})"))
            continue
        try:
            out[a.dest] = convert(a, raw, from_env=False)
        except ValueError as e:
            problems.append(Problem(where, line, f"{key}: {e}"))
    return out, problems


def check_file(p: argparse.ArgumentParser, service: str, path: Path) -> list[Problem]:
    """Everything wrong with `path` as the TOML file of `patchswarm <service>` (empty: it is fine)."""
    try:
        values, lines = read_file(path)
    except ConfigError as e:
        return e.problems
    return _file_values(p, service, path, values, lines)[1]


def file_service(path: Path) -> str | None:
    """The `service = ...` a file declares, if it reads as TOML and declares one."""
    try:
        values, _ = read_file(path)
    except ConfigError:
        return None
    s = values.get(SERVICE_KEY)
    return s if isinstance(s, str) else None


# ---------------------------------------------------------------- layering


def prepare(p: argparse.ArgumentParser) -> None:
    """Before parsing: every configurable flag of `p` defaults to UNSET and is not required."""
    for a in _options(p):
        a.layer_default = a.default  # type: ignore[attr-defined]
        a.layer_required = a.required  # type: ignore[attr-defined]
        a.default = UNSET
        a.required = False
    for a in p._actions:
        if a.dest == "config":
            a.default = UNSET


def resolve(p: argparse.ArgumentParser, service: str, args: argparse.Namespace, environ: dict[str, str]) -> None:
    """After parsing: fill what the command line did not give from the environment, the file, the defaults.

    Raises ConfigError listing every bad value and every required flag given nowhere.
    """
    problems: list[Problem] = []
    path = args.config
    if path is UNSET:
        path = Path(environ[CONFIG_ENV]) if environ.get(CONFIG_ENV) else None
    args.config = path
    from_file: dict[str, object] = {}
    if path is not None:
        try:
            values, lines = read_file(path)
            from_file, problems = _file_values(p, service, path, values, lines)
        except ConfigError as e:
            problems = list(e.problems)
    missing = []
    for a in _options(p):
        if getattr(args, a.dest) is not UNSET:
            continue
        name = env_name(a)
        if name in environ:
            try:
                setattr(args, a.dest, convert(a, environ[name], from_env=True))
            except ValueError as e:
                problems.append(Problem(name, None, str(e)))
                setattr(args, a.dest, None)
            continue
        if a.dest in from_file:
            setattr(args, a.dest, from_file[a.dest])
            continue
        setattr(args, a.dest, a.layer_default)
        if a.layer_required:
            missing.append(a)
    for a in missing:
        problems.append(Problem(f"--{_key(a)}", None, f"required: give the flag, {env_name(a)}, or "
                                                      f"`{_key(a)} = ...` in the --config file"))
    if problems:
        raise ConfigError(problems)
