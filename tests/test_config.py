"""Tests for tltjax/config.py, the CLI in tltjax/main.py and the configs/ files."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from ml_collections import ConfigDict

from tltjax import jobs, main, paths
from tltjax.config import (
    REPO_ROOT,
    ConfigError,
    available_configs,
    default_config_path,
    format_config,
    load_config,
    parse_argv,
    set_from_string,
)

MICRO = "configs/micro.py"


def _config(**fields) -> ConfigDict:
    config = ConfigDict(fields)
    config.lock()
    return config


def _run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(
        [sys.executable, "-m", "tltjax.main", *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)


def test_every_config_file_loads_locked():
    """Every file in configs/ has get_config(), loads, names a registered job, and is locked."""
    assert {"configs/default.py", "configs/micro.py"} <= set(available_configs())
    for path in available_configs():
        config = load_config(path)
        assert config.is_locked
        assert config.job in jobs.JOBS


def test_micro_has_the_default_structure():
    """configs/micro.py has exactly the default's key tree, so tests exercise every field."""

    def tree(config):
        return {k: tree(v) if isinstance(v, ConfigDict) else None for k, v in config.items()}

    micro, default = load_config(MICRO), load_config(default_config_path())
    assert tree(micro) == tree(default)
    assert micro.model.hidden_size == 64 and micro.sft.steps == 30


@pytest.mark.parametrize(
    "override, key, expected",
    [
        ("--config.sft.steps=7", "sft.steps", 7),
        ("--config.sft.lr=1e-3", "sft.lr", 1e-3),
        ("--config.sft.lr=2", "sft.lr", 2.0),
        ("config.task.name=gsm8k", "task.name", "gsm8k"),
        ("--config.cache_dir=", "cache_dir", ""),
        ("--config.model.tie_word_embeddings=FALSE", "model.tie_word_embeddings", False),
        ("--config.model.tie_word_embeddings=yes", "model.tie_word_embeddings", True),
        ("--config.model.tie_word_embeddings=0", "model.tie_word_embeddings", False),
    ],
)
def test_scalar_overrides_parse_by_field_type(override, key, expected):
    """An override's text becomes a value of the field's type (int, float incl. 1e-3 and ints, str, bool)."""
    config = load_config(MICRO, [override])
    value = config
    for part in key.split("."):
        value = value[part]
    assert value == expected and type(value) is type(expected)


@pytest.mark.parametrize("text", ["1,2,3", "(1,2,3)", "[1, 2, 3]", "1,2,3,"])
def test_sequence_overrides_keep_the_sequence_type(text):
    """Tuples and lists accept a,b,c / (a,b,c) / [a,b,c], parse elements by type, keep tuple vs list."""
    config = _config(layers=(4,), names=["a"])
    set_from_string(config, "layers", text)
    set_from_string(config, "names", "[x, 'y']")
    assert config.layers == (1, 2, 3) and config.names == ["x", "y"]
    set_from_string(config, "layers", "()")
    assert config.layers == ()


def test_none_fields_take_none_or_a_typed_value():
    """A None field accepts none/null, a placeholder parses by its declared type, an untyped one as a literal."""
    from ml_collections import config_dict

    config = _config(untyped=None, steps=config_dict.placeholder(int))
    set_from_string(config, "untyped", "null")
    assert config.untyped is None
    set_from_string(config, "untyped", "0.5")
    set_from_string(config, "steps", "12")
    assert config.steps == 12 and config.untyped == 0.5
    with pytest.raises(ConfigError, match=r"config.steps expects int"):
        set_from_string(config, "steps", "none")  # no longer None: typed like any int field
    config.steps = None
    with pytest.raises(ConfigError, match=r"config.steps expects int"):
        set_from_string(config, "steps", "many")


def test_later_overrides_win_and_argv_two_token_form():
    """parse_argv reads --config PATH, --config.KEY VALUE, and applies overrides in order."""
    config, rest = parse_argv(
        ["--config", MICRO, "--config.sft.steps", "5", "--config.sft.steps=9", "--config.sft.lr", "-1e-4", "extra"])
    assert config.sft.steps == 9 and config.sft.lr == -1e-4
    assert rest == ["extra"]


def test_unknown_key_lists_valid_keys_and_suggests_the_near_one():
    """A misspelled key is an error naming it, the valid keys at that level, and the nearest ones."""
    with pytest.raises(ConfigError) as info:
        load_config(MICRO, ["--config.sft.lrr=1e-3"])
    message = str(info.value)
    assert "config.sft.lrr" in message
    assert "Did you mean config.sft.lr?" in message
    assert "batch_size, grad_clip, log_every, lr, seq_len, slip_rate, steps, warmup_steps, weight_decay" in message
    with pytest.raises(ConfigError, match=r"Did you mean config.model\?"):
        load_config(MICRO, ["--config.modle.hidden_size=8"])


@pytest.mark.parametrize(
    "override, pattern",
    [
        ("--config.sft.steps=abc", r"config.sft.steps expects int .*got 'abc'"),
        ("--config.sft.steps=1.5", r"config.sft.steps expects int .*got '1.5'"),
        ("--config.sft.lr=fast", r"config.sft.lr expects float .*got 'fast'"),
        ("--config.model.tie_word_embeddings=maybe", r"expects a bool .*got 'maybe'"),
        ("--config.seed.x=1", r"config.seed is a value .*not a section"),
    ],
)
def test_wrong_type_names_key_type_and_value(override, pattern):
    """A value that does not parse as the field's type is an error with the key, the type and the value."""
    with pytest.raises(ConfigError, match=pattern):
        load_config(MICRO, [override])


def test_sequence_of_wrong_elements_is_an_error():
    """A tuple override whose elements do not parse as the existing elements' type is an error."""
    with pytest.raises(ConfigError, match=r"config.layers expects a sequence of int.*got 'a,b'"):
        set_from_string(_config(layers=(1, 2)), "layers", "a,b")


def test_section_cannot_be_overridden_by_a_scalar():
    """Assigning a scalar to a nested ConfigDict is an error that lists the section's fields."""
    with pytest.raises(ConfigError, match=r"config.model is a section.*hidden_size.*--config.model.hidden_size="):
        load_config(MICRO, ["--config.model=3"])


def test_malformed_overrides_are_errors():
    """Overrides without the config. prefix or without a value are errors, not silently ignored."""
    with pytest.raises(ConfigError, match=r"must look like --config.KEY=VALUE"):
        load_config(MICRO, ["sft.lr=1"])
    with pytest.raises(ConfigError, match=r"has no value"):
        load_config(MICRO, ["--config.sft.lr"])
    with pytest.raises(ConfigError, match=r"needs a value"):
        parse_argv(["--config.sft.lr"], default=MICRO)
    with pytest.raises(ConfigError, match=r"given twice"):
        parse_argv(["--config", MICRO, f"--config={MICRO}"])


def test_missing_config_is_an_error_naming_the_configs_unless_defaulted(tmp_path, monkeypatch):
    """Without --config, parse_argv needs a default; the CLI default loads from any working directory."""
    with pytest.raises(ConfigError, match=r"pass --config=PATH.*configs/micro.py"):
        parse_argv(["--config.seed=1"])
    monkeypatch.chdir(tmp_path)
    config, _ = parse_argv(["--config.seed=1"], default=default_config_path())
    assert config.job == "rl" and config.seed == 1
    assert load_config(MICRO).workdir == "runs/micro"  # repo-relative paths work from anywhere
    with pytest.raises(ConfigError, match=r"not found. Did you mean configs/micro.py\?"):
        load_config("configs/mikro.py")


def test_loaded_config_is_locked():
    """Adding or reading a misspelled field of a loaded config raises, so typos in code fail."""
    config = load_config(MICRO)
    with pytest.raises(AttributeError):
        config.sft.lrr = 1.0
    with pytest.raises(AttributeError):
        _ = config.sft.lrr
    config.sft.lr = 1.0  # existing fields stay writable
    assert config.sft.lr == 1.0


def test_format_config_is_sorted_yaml_style():
    """format_config prints one key per line, nested sections indented, in sorted order."""
    text = format_config(_config(b=(1, 2), a={"y": None, "x": True}, c="s"))
    assert text == "a:\n  x: true\n  y: null\nb: [1, 2]\nc: 's'"


def test_main_dispatches_on_config_job(monkeypatch, capsys):
    """main() runs the job that config.job names and returns its exit status."""
    seen = []
    monkeypatch.setitem(jobs.JOBS, "test_echo", lambda config: seen.append(config.sft.steps) or 7)
    assert main.main([f"--config={MICRO}", "--config.job=test_echo", "--config.sft.steps=3"]) == 7
    assert seen == [3]


def test_main_config_errors_exit_2(capsys):
    """Unknown jobs and stray arguments are config errors: status 2, message on stderr."""
    assert main.main([f"--config={MICRO}", "--config.job=sft_dem"]) == 2
    assert "unknown job config.job='sft_dem'. Did you mean 'sft_demo'?" in capsys.readouterr().err
    assert main.main([f"--config={MICRO}", "stray"]) == 2
    assert "unrecognized arguments: stray" in capsys.readouterr().err


def test_register_job_rejects_duplicates():
    """Two jobs cannot share a name."""
    with pytest.raises(ValueError, match="already registered"):
        jobs.register_job("sft_demo")(lambda config: 0)


def test_cli_bogus_key_exits_2_without_traceback(tmp_path):
    """python -m tltjax.main with an unknown key exits 2 with a one-line, actionable message."""
    result = _run_cli(f"--config={MICRO}", "--config.bogus=1", cwd=tmp_path)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "unknown config key config.bogus" in result.stderr
    valid = ", ".join(sorted(load_config(MICRO).keys()))
    assert f"Valid keys in config: {valid}." in result.stderr


def test_cli_help_lists_configs_and_jobs(tmp_path):
    """--help prints usage, the config files and the jobs, and with --config that config's fields."""
    result = _run_cli("--help", f"--config={MICRO}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: python -m tltjax.main")
    assert "configs/micro.py" in result.stdout and "sft_demo" in result.stdout
    assert "  hidden_size: 64" in result.stdout


def test_cache_dir_precedence(tmp_path, monkeypatch):
    """cache_dir uses the config value, else $TLTJAX_CACHE, else ~/.cache/tltjax, and creates it."""
    monkeypatch.setenv("TLTJAX_CACHE", str(tmp_path / "env"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert paths.cache_dir(str(tmp_path / "cfg")) == tmp_path / "cfg"
    assert paths.cache_dir() == tmp_path / "env"
    monkeypatch.delenv("TLTJAX_CACHE")
    assert paths.cache_dir() == tmp_path / "home" / ".cache" / "tltjax"
    assert (tmp_path / "home" / ".cache" / "tltjax").is_dir()
