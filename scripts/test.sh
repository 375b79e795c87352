#!/usr/bin/env bash
# Sets up every environment this project tests in (idempotent) and runs all tests:
# lint, unit tests (.venvs/core), SGLang integration tests (.venvs/sglang), vLLM integration tests (.venvs/vllm).
# Usage: scripts/test.sh [unit|sglang|vllm ...]   (default: all of them)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
suites=("$@")
[ ${#suites[@]} -gt 0 ] || suites=(unit sglang vllm)
export TRITON_INTERPRET=1
status=0
for suite in "${suites[@]}"; do
  case "$suite" in
    unit)
      scripts/setup_env.sh core
      .venvs/core/bin/ruff check .
      .venvs/core/bin/python -m pytest tests -q -p no:cacheprovider || status=1
      ;;
    sglang|vllm)
      scripts/setup_env.sh "$suite"
      ".venvs/$suite/bin/python" -m pytest "integration_tests/$suite" -q -p no:cacheprovider || status=1
      ;;
    *)
      echo "test.sh: unknown suite '$suite' (choose unit, sglang, vllm)" >&2
      exit 2
      ;;
  esac
done
exit $status
