"""Command line: ``python -m tltjax.main --config=configs/NAME.py --config.KEY=VALUE ...``.

Loads the config (the embedded default without ``--config``), then runs the job that
``config.job`` names in `tltjax.jobs.JOBS`. Config errors exit with status 2 and a
message, without a traceback.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Sequence

from tltjax import config as config_lib
from tltjax import distributed, jobs

USAGE = """\
usage: python -m tltjax.main [--config=PATH] [--config.KEY=VALUE ...]

Runs the job named by config.job with the config loaded from PATH (a Python file
with get_config(); default: {default}). Override any field by its dotted path;
values are parsed by the field's type:

  --config.sft.lr=1e-3            int / float / str
  --config.model.tie_word_embeddings=false
  --config.some.tuple=1,2,3       also (1,2,3) or [1,2,3]
  --config.sft.steps 100          two-token form

options:
  -h, --help                      show this message, the configs and the jobs;
                                  with --config, also that config's fields
"""


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the CLI on `argv` (default ``sys.argv[1:]``); returns the process exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    default = config_lib.default_config_path()
    if "-h" in argv or "--help" in argv:
        _print_help([a for a in argv if a not in ("-h", "--help")], default)
        return 0
    try:
        config, rest = config_lib.parse_argv(argv, default=default)
        if rest:
            raise config_lib.ConfigError(
                f"unrecognized arguments: {' '.join(rest)} (expected --config=PATH and --config.KEY=VALUE)")
        job = jobs.get_job(config.job)
        distributed.initialize(config)
        print(f"job {config.job} with config:\n{config_lib.format_config(config)}", flush=True)
        return job(config)
    except config_lib.ConfigError as e:
        print(f"error: {e}\n(run python -m tltjax.main --help for usage)", file=sys.stderr)
        return 2


def _print_help(argv: list[str], default: Path) -> None:
    print(USAGE.format(default=_display(default)))
    print("configs: " + (", ".join(config_lib.available_configs()) or "(no configs/ directory)"))
    print("jobs: " + ", ".join(sorted(jobs.JOBS)))
    if any(a == "--config" or a.startswith("--config=") for a in argv):
        try:
            config, _ = config_lib.parse_argv(argv)
        except config_lib.ConfigError as e:
            print(f"\nerror: {e}", file=sys.stderr)
            return
        print(f"\nfields:\n{config_lib.format_config(config)}")


def _display(path: Path) -> str:
    try:
        return str(path.relative_to(config_lib.REPO_ROOT))
    except ValueError:
        return str(path)


if __name__ == "__main__":
    sys.exit(main())
