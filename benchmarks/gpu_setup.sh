#!/usr/bin/env bash
# Install bitsandbytes and flash-attn-4 on a GPU machine without network access, from the folder
# benchmarks/prepare_wheels.sh filled: split wheels are joined with cat, then pip installs from the folder alone.
#
#   bash benchmarks/gpu_setup.sh benchmarks/wheels
set -euo pipefail
dir=${1:-benchmarks/wheels}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp "$dir"/*.whl "$work"/ 2>/dev/null || true
for first in "$dir"/*.whl.part.00; do
  [ -e "$first" ] || continue
  name=$(basename "${first%.part.00}")
  cat "${first%.part.00}".part.* > "$work/$name"
done
# the folder holds the complete set prepare_wheels.sh resolved: install exactly those files, nothing resolved here
python -m pip install --quiet --no-index --no-deps "$work"/*.whl
python - <<'PY'
import bitsandbytes, flash_attn.cute, torch
print(f"bitsandbytes {bitsandbytes.__version__}, flash_attn.cute importable, torch {torch.__version__}, "
      f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA device'}")
PY
