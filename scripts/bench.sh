#!/usr/bin/env bash
# The main job: sets up .venvs/core (idempotent) and runs the A/B benchmark; arguments go to
# `hybrid-prefix-cache bench` (with none: the bundled default trace, every backend, paper-7b, 1/2/5 GB).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/setup_env.sh" core
exec "$root/.venvs/core/bin/hybrid-prefix-cache" bench "$@"
