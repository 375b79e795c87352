# SGLang environment: integration tests against the real SGLang 0.5.20 classes and the `--engine sglang` baseline
# of the benchmark, on a CPU-only machine. Run through scripts/setup_env.sh sglang (which provides VENV, ROOT, PIP).
#
# 0.5.20 is the last release that ships mem_cache/mamba_radix_cache.py. Its wheel is installed with --no-deps
# because its dependency list pulls CUDA-only kernel packages; only what the imports need is added, at the versions
# sglang 0.5.20 pins: sglang.srt.managers.scheduler and mem_cache, plus sglang.srt.entrypoints.engine/http_server
# (uvloop, jsonschema, python-multipart, soundfile) so plugin loading can be exercised through them. torch==2.13.0
# is repeated on every pip call so no dependency can swap the local CPU wheel for a CUDA build. Triton kernels run
# on CPU tensors with TRITON_INTERPRET=1; the imports need no environment variable.
set -euo pipefail
$PIP install -q "torch==2.13.0"
$PIP install -q --no-deps "sglang==0.5.20"
$PIP install -q "torch==2.13.0" \
  "transformers==5.12.1" "tokenizers==0.22.2" "xgrammar==0.2.1" "apache-tvm-ffi==0.1.11" \
  "compressed-tensors==0.18.0" "openai==2.6.1" \
  numpy orjson psutil pybase64 requests packaging pillow starlette msgspec pyzmq tqdm IPython pydantic aiohttp \
  dill gguf partial_json_parser sentencepiece triton setproctitle einops uvicorn fastapi \
  uvloop jsonschema python-multipart "soundfile==0.13.1" \
  "pytest>=8" "hypothesis>=6.100" "ruff>=0.6" prometheus_client

# sglang.srt.utils.common imports torchvision.io at load time, and transformers then imports torchvision.transforms
# because it finds the package. PyPI's torchvision wheels are CUDA builds that fail to load beside CPU torch, so a
# stand-in package goes into site-packages instead: it defines the names imported at module level and raises a clear
# error if any image function is actually called. It has no dist-info, so pip still reports torchvision as missing;
# a real torchvision installed by hand is removed first so the two never mix.
if "$VENV/bin/python" -c 'import importlib.metadata as m; m.version("torchvision")' 2>/dev/null; then
  $PIP uninstall -q -y torchvision
fi
site_packages=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
standin="$site_packages/torchvision"
rm -rf "$standin"
mkdir -p "$standin/transforms/v2"
cat > "$standin/__init__.py" <<'EOF'
"""Stand-in for torchvision, written by scripts/envs/sglang.sh (hybrid-prefix-cache test environment).

PyPI's torchvision wheels are CUDA builds that cannot load beside the CPU torch wheel; SGLang and transformers only
import a few names from torchvision at load time. This package defines those names; calling any image function
raises RuntimeError. Installing the real torchvision replaces it.
"""

__version__ = "0.0.0+standin"
IS_STANDIN = True


def unavailable(name: str):
    def raise_unavailable(*args, **kwargs):
        raise RuntimeError(
            f"torchvision.{name} is not available: this environment has a torchvision stand-in "
            "(scripts/envs/sglang.sh) because PyPI's torchvision wheels need CUDA"
        )

    raise_unavailable.__name__ = name.rsplit(".", 1)[-1]
    return raise_unavailable
EOF
cat > "$standin/io.py" <<'EOF'
"""Stand-in for torchvision.io (see torchvision/__init__.py): no image decoding."""

from enum import Enum

from torchvision import unavailable


class ImageReadMode(Enum):
    UNCHANGED = 0
    GRAY = 1
    GRAY_ALPHA = 2
    RGB = 3
    RGB_ALPHA = 4
    RGBA = RGB_ALPHA


decode_jpeg = unavailable("io.decode_jpeg")
decode_image = unavailable("io.decode_image")
read_image = unavailable("io.read_image")
EOF
cat > "$standin/transforms/__init__.py" <<'EOF'
"""Stand-in for torchvision.transforms (see torchvision/__init__.py): only the InterpolationMode enum."""

from enum import Enum


class InterpolationMode(Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"
EOF
cat > "$standin/transforms/functional.py" <<'EOF'
"""Stand-in for torchvision.transforms.functional (see torchvision/__init__.py)."""

from torchvision import unavailable
from torchvision.transforms import InterpolationMode

__all__ = ["InterpolationMode", "pil_to_tensor"]

pil_to_tensor = unavailable("transforms.functional.pil_to_tensor")
EOF
cat > "$standin/transforms/v2/__init__.py" <<'EOF'
"""Stand-in for torchvision.transforms.v2 (see torchvision/__init__.py)."""
EOF
cat > "$standin/transforms/v2/functional.py" <<'EOF'
"""Stand-in for torchvision.transforms.v2.functional (see torchvision/__init__.py): no image transforms."""
EOF

$PIP install -q --no-deps -e "$ROOT"
