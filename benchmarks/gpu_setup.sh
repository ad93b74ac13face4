#!/usr/bin/env bash
# Install, on a GPU machine without network access, whatever subset of the wheels benchmarks/prepare_wheels.sh
# fetched is present: split wheels are joined when all their pieces are there (and their sha256 checks out), every
# complete wheel is installed with pip --no-index --no-deps, and the script says which rows of the suite that
# enables (bitsandbytes: the 8-bit optimizer rows; flash-attn-4: the flash-attn attention row). A wheel still missing
# pieces is left out with a message; the suite runs without it and its rows say why they were not measured.
#
#   bash benchmarks/gpu_setup.sh benchmarks/wheels/*
set -euo pipefail
if [ "$#" -eq 0 ]; then set -- benchmarks/wheels/*; fi
exec python "$(dirname "$0")/_wheels.py" install "$@"
