"""The one config system: ml_collections config files plus command-line overrides.

A config file is a Python file with ``get_config() -> ConfigDict``. Overrides name a
field by its dotted path and are parsed by the type of the value already there::

    config = load_config("configs/micro.py", ["--config.sft.lr=1e-3",
                                              "--config.model.num_hidden_layers=3"])

Unknown keys, values of the wrong type, and scalars assigned to sections are
`ConfigError`s that name the key and say what would have been valid. Loaded configs
are locked, so reading or adding a misspelled field in code fails too.
"""

from __future__ import annotations

import ast
import difflib
import importlib.util
from pathlib import Path
from typing import Any, Sequence

from ml_collections import ConfigDict

REPO_ROOT = Path(__file__).resolve().parent.parent
CONFIGS_DIR = REPO_ROOT / "configs"

_PREFIX = "config."
_TRUE = ("true", "1", "yes")
_FALSE = ("false", "0", "no")
_NONE = ("none", "null")


class ConfigError(ValueError):
    """A config file, override or value that cannot be used; the message says how to fix it."""


def available_configs() -> list[str]:
    """Config files under ``configs/`` as repository-relative paths (empty if not a checkout)."""
    if not CONFIGS_DIR.is_dir():
        return []
    return sorted(f"configs/{p.name}" for p in CONFIGS_DIR.glob("*.py") if not p.name.startswith("_"))


def default_config_path() -> Path:
    """``configs/default.py`` of this checkout, else the copy shipped in the package."""
    path = CONFIGS_DIR / "default.py"
    return path if path.is_file() else Path(__file__).resolve().parent / "default_config.py"


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> ConfigDict:
    """Loads ``get_config()`` from the file at `path`, applies `overrides`, and locks it.

    A relative `path` is looked up in the working directory, then in the repository
    root, so ``configs/micro.py`` works from any directory. Each override is
    ``--config.KEY=VALUE`` or ``config.KEY=VALUE``; later ones win.
    """
    file = _resolve_path(path)
    spec = importlib.util.spec_from_file_location(f"_tltjax_config_{file.stem}", file)
    if spec is None or spec.loader is None:
        raise ConfigError(f"cannot load config file {file}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    get_config = getattr(module, "get_config", None)
    if not callable(get_config):
        raise ConfigError(f"config file {file} must define get_config() returning a ConfigDict")
    config = get_config()
    if isinstance(config, dict):
        config = ConfigDict(config)
    if not isinstance(config, ConfigDict):
        raise ConfigError(
            f"get_config() in {file} returned {type(config).__name__}; it must return a ConfigDict")
    config.lock()
    for override in overrides:
        key, sep, value = _strip_prefix(override).partition("=")
        if not sep:
            raise ConfigError(f"override {override!r} has no value; write --config.{key}=VALUE")
        set_from_string(config, key, value)
    return config


def parse_argv(argv: Sequence[str], default: str | Path | None = None) -> tuple[ConfigDict, list[str]]:
    """Builds the config named by ``--config=PATH`` in `argv` with its ``--config.KEY`` overrides.

    `argv` excludes the program name. Accepts ``--config=PATH``, ``--config PATH``,
    ``--config.KEY=VALUE`` and ``--config.KEY VALUE``. Without ``--config``, loads
    `default`, or raises `ConfigError` listing the config files if `default` is None.
    Everything else (and everything after ``--``) is returned unparsed, in order.
    """
    path: str | None = None
    overrides: list[str] = []
    rest: list[str] = []
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            rest.extend(args[i + 1:])
            break
        if arg == "--config" or arg.startswith("--config="):
            if path is not None:
                raise ConfigError(f"--config given twice ({path!r} and {arg!r}); pass one config file")
            if arg == "--config":
                path = _next_value(args, i, "--config")
                i += 1
            else:
                path = arg.partition("=")[2]
        elif arg.startswith("--" + _PREFIX):
            if "=" not in arg:
                arg = f"{arg}={_next_value(args, i, arg)}"
                i += 1
            overrides.append(arg)
        else:
            rest.append(arg)
        i += 1
    if path is None:
        if default is None:
            raise ConfigError(f"no config given; pass --config=PATH. {_list_configs()}")
        path = str(default)
    return load_config(path, overrides), rest


def set_from_string(config: ConfigDict, key: str, value: str) -> None:
    """Sets the field at dotted `key` (e.g. ``"sft.lr"``) from the command-line text `value`.

    The text is parsed by the type of the field's current value (see `load_config`).
    """
    parts = key.split(".")
    node = config
    for depth, name in enumerate(parts):
        here = ".".join(["config", *parts[:depth]])
        if not isinstance(node, ConfigDict):
            raise ConfigError(
                f"cannot set config.{key}: {here} is a value ({node!r}), not a section")
        if name not in node:
            raise ConfigError(_unknown_key_message(node, name, here, key))
        if depth < len(parts) - 1:
            node = node[name]
    name = parts[-1]
    current = node[name]
    if isinstance(current, ConfigDict):
        fields = ", ".join(current.keys())
        raise ConfigError(
            f"config.{key} is a section, not a value; override one of its fields "
            f"({fields}), e.g. --config.{key}.{next(iter(current.keys()), 'FIELD')}=VALUE")
    parsed = _parse(value, current, node.get_type(name), f"config.{key}")
    try:
        node[name] = parsed
    except TypeError as e:
        raise ConfigError(f"cannot set config.{key} to {parsed!r}: {e}") from e


def format_config(config: ConfigDict, indent: int = 0) -> str:
    """YAML-style text of `config` with sorted keys, for logs."""
    lines = []
    for key in sorted(config.keys()):
        value = config[key]
        pad = " " * indent
        if isinstance(value, ConfigDict):
            lines.append(f"{pad}{key}:")
            lines.append(format_config(value, indent + 2))
        else:
            lines.append(f"{pad}{key}: {_format_value(value)}")
    return "\n".join(line for line in lines if line)


# --- helpers -------------------------------------------------------------------------------------


def _resolve_path(path: str | Path) -> Path:
    path = Path(path).expanduser()
    candidates = [path] if path.is_absolute() else [path, REPO_ROOT / path]
    for candidate in candidates:
        if candidate.is_file():
            return candidate.resolve()
    hint = ""
    near = difflib.get_close_matches(str(path), available_configs(), n=1)
    if near:
        hint = f" Did you mean {near[0]}?"
    raise ConfigError(f"config file {str(path)!r} not found.{hint} {_list_configs()}")


def _list_configs() -> str:
    configs = available_configs()
    if not configs:
        return "No configs/ directory next to the package."
    return "Available configs: " + ", ".join(configs) + "."


def _strip_prefix(override: str) -> str:
    text = override[2:] if override.startswith("--") else override
    if not text.startswith(_PREFIX):
        raise ConfigError(f"override {override!r} must look like --config.KEY=VALUE")
    return text[len(_PREFIX):]


def _next_value(args: list[str], i: int, flag: str) -> str:
    if i + 1 >= len(args) or args[i + 1].startswith("--"):
        raise ConfigError(f"{flag} needs a value: write {flag}=VALUE")
    return args[i + 1]


def _unknown_key_message(node: ConfigDict, name: str, here: str, key: str) -> str:
    valid = sorted(node.keys())
    message = f"unknown config key config.{key}: {here} has no field {name!r}."
    near = difflib.get_close_matches(name, valid, n=3, cutoff=0.6)
    if near:
        message += " Did you mean " + " or ".join(f"{here}.{n}" for n in near) + "?"
    return message + f" Valid keys in {here}: {', '.join(valid)}."


def _parse(text: str, current: Any, field_type: type, key: str) -> Any:
    """Parses `text` as a value for a field of `field_type` whose value is `current`."""
    if current is None:
        if text.strip().lower() in _NONE:
            return None
        if field_type is type(None):  # untyped None field: take the value as written
            return _parse_literal(text)
    if field_type in (tuple, list):
        return field_type(_parse_sequence(text, current, key))
    if field_type in (bool, int, float, str):
        return _parse_scalar(text, field_type, key)
    raise ConfigError(f"{key} holds a {field_type.__name__}, which cannot be set from the command line")


def _parse_scalar(text: str, field_type: type, key: str) -> Any:
    if field_type is str:
        return text
    word = text.strip()
    if field_type is bool:
        if word.lower() in _TRUE:
            return True
        if word.lower() in _FALSE:
            return False
        raise ConfigError(f"{key} expects a bool (true/false, yes/no, 1/0), got {text!r}")
    try:
        return field_type(word)
    except ValueError:
        example = {int: "3", float: "1e-3"}[field_type]
        raise ConfigError(f"{key} expects {field_type.__name__} (e.g. {example}), got {text!r}") from None


def _parse_sequence(text: str, current: Any, key: str) -> list[Any]:
    body = text.strip()
    if body[:1] + body[-1:] in ("()", "[]"):
        body = body[1:-1].strip()
    items = [item.strip() for item in body.split(",")] if body else []
    if items and not items[-1]:  # trailing comma, as in "(1,)"
        items.pop()
    element_types = {type(x) for x in current or ()}
    if len(element_types) != 1 or not element_types <= {bool, int, float, str}:
        return [_parse_literal(item) for item in items]
    (element_type,) = element_types
    try:
        return [_parse_scalar(_unquote(item), element_type, key) for item in items]
    except ConfigError:
        raise ConfigError(
            f"{key} expects a sequence of {element_type.__name__} (e.g. 1,2,3 or (1,2,3)), got {text!r}"
        ) from None


def _parse_literal(text: str) -> Any:
    word = text.strip()
    lowered = word.lower()
    if lowered in _NONE:
        return None
    if lowered in ("true", "false"):
        return lowered == "true"
    try:
        return ast.literal_eval(word)
    except (ValueError, SyntaxError):
        return text


def _unquote(text: str) -> str:
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text


def _format_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(_format_value(v) for v in value) + "]"
    return repr(value)
