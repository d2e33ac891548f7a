#!/usr/bin/env bash
# Single-host launcher: sets up the JAX environment, then runs the tltjax CLI.
#
#   launch/single_host.sh [--devices N] [--config=PATH] [--config.KEY=VALUE ...]
#
# --devices N  split the CPU into N virtual JAX devices (to try multi-device code without
#              accelerators); it must come first. All other arguments go to python -m tltjax.main.
set -euo pipefail

if [[ "${1:-}" == --devices || "${1:-}" == --devices=* ]]; then
  if [[ "$1" == --devices=* ]]; then n="${1#--devices=}"; shift; else n="${2:-}"; shift $(( $# > 1 ? 2 : 1 )); fi
  if ! [[ "$n" =~ ^[1-9][0-9]*$ ]]; then
    echo "error: --devices needs a positive integer, got '${n}'" >&2
    exit 2
  fi
  export JAX_PLATFORMS=cpu
  export XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_force_host_platform_device_count=$n"
fi

# GPU: allocate memory as needed instead of grabbing 75% at start-up, so that several
# processes (or a profiler) can share a device. No effect on CPU.
export XLA_PYTHON_CLIENT_PREALLOCATE="${XLA_PYTHON_CLIENT_PREALLOCATE:-false}"

# Import this checkout's tltjax even when it is not pip-installed. Relative paths (workdir,
# --config) stay relative to the caller's directory; configs/... is also found from the repo.
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python}" -m tltjax.main "$@"
