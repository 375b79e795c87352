#!/usr/bin/env bash
# Creates or updates the virtual environment .venvs/NAME (core, sglang or vllm). Idempotent: a venv whose
# recipe (scripts/envs/NAME.sh) and project metadata are unchanged since its last successful setup is reused as is.
set -euo pipefail
name=${1:?usage: scripts/setup_env.sh core|sglang|vllm}
root=$(cd "$(dirname "$0")/.." && pwd)
recipe="$root/scripts/envs/$name.sh"
[ -f "$recipe" ] || { echo "setup_env: no recipe for '$name' (expected $recipe)" >&2; exit 2; }
venv="$root/.venvs/$name"
stamp="$venv/.hpc-setup-stamp"
fingerprint=$(cat "$recipe" "$root/pyproject.toml" "$root/setup.py" | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$fingerprint" ]; then
  exit 0
fi
python=${HPC_PYTHON:-python3.11}
command -v "$python" >/dev/null || python=python3
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
export PIP_DISABLE_PIP_VERSION_CHECK=1
echo "setup_env: preparing .venvs/$name" >&2
VENV="$venv" ROOT="$root" PIP="$venv/bin/python -m pip" bash "$recipe"
echo "$fingerprint" > "$stamp"
