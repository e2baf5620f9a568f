#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one run (none of them runs in CI, which has no GPU):
#   1. the sparse hand-off's CUDA tests (tests/test_changes.py, tests/test_changelog.py: every
#      dtype written into GPU tensors bit for bit, a real socket with a bootstrap onto the GPU);
#   2. bench/handoff.py with the engine's copy on the GPU at SIZES GiB (default 1,4), then the
#      same on the host at the smallest size, for the side-by-side "copy s" columns.
# Run from the repository root with patchswarm importable (installed, or PYTHONPATH set):
#   bash bench/gpu_check.sh [SIZES]
# The bench needs about 3x the largest size in host memory and 1x on the GPU.
set -o pipefail
sizes=${1:-1,4}
py=${PYTHON:-python3}
"$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: nothing to check here')" || exit 2
"$py" -c "import torch; print(torch.__version__, torch.cuda.get_device_name())"
status=0
timeout 300 "$py" -m pytest -q -p no:cacheprovider tests/test_changes.py tests/test_changelog.py -k "gpu or cuda" || status=1
timeout 600 "$py" bench/handoff.py --sizes "$sizes" --versions 3 --device cuda || status=1
timeout 300 "$py" bench/handoff.py --sizes "${sizes%%,*}" --versions 2 --device cpu || status=1
exit $status
