#!/usr/bin/env bash
# Download, on a machine with network access, the wheels the benchmark suite needs on a GPU machine without it:
# bitsandbytes and flash-attn-4 with what flash-attn-4 needs beyond a CUDA PyTorch install. Wheels larger than 40 MB
# (nvidia-cutlass-dsl-libs-cu12, about 92 MB) are split into 40 MB pieces, which gpu_setup.sh joins again.
#
#   benchmarks/prepare_wheels.sh benchmarks/wheels
#
# Run it with the Python version of the GPU machine (the compiled wheels are built per Python version); the folder
# then travels with the checkout. It is a download cache: never commit it.
set -euo pipefail
dir=${1:?usage: benchmarks/prepare_wheels.sh DIR}
mkdir -p "$dir"
report=$(mktemp)
trap 'rm -f "$report"' EXIT
# what installing flash-attn-4 adds to this environment (torch and its own dependencies are already there)
python -m pip install --dry-run --quiet --report "$report" "flash-attn-4>=4.0.0b0" 2>/dev/null
pins=$(python - "$report" <<'PY'
import json, sys
print(" ".join(f"{i['metadata']['name']}=={i['metadata']['version']}" for i in json.load(open(sys.argv[1]))["install"]))
PY
)
python -m pip download --quiet --no-deps --only-binary=:all: --dest "$dir" "bitsandbytes>=0.50" $pins
for wheel in "$dir"/*.whl; do
  if [ "$(stat -c %s "$wheel")" -gt $((40 * 1024 * 1024)) ]; then
    split -b 40M -d -a 2 "$wheel" "$wheel.part."
    rm "$wheel"
  fi
done
ls -l "$dir"
