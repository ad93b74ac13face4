#!/usr/bin/env bash
# Download, on a machine with network access, the wheels the benchmark suite needs on a GPU machine without it:
# bitsandbytes (cut down to the libraries of one CUDA version) and flash-attn-4 with what it adds to a CUDA PyTorch
# install (nvidia-cutlass-dsl with the libraries of that CUDA major version, quack-kernels, apache-tvm-ffi, ...).
#
#   bash benchmarks/prepare_wheels.sh benchmarks/wheels 3.12 13
#
# The wheels are for the GPU machine's Python (3.12 on the usual CUDA PyTorch image) and its PyTorch's CUDA major
# version (13; "13.0" keeps bitsandbytes' one CUDA 13.0 library). Wheels over 40 MiB (nvidia-cutlass-dsl-libs-cu13,
# about 88 MiB) are split into pieces with a manifest, and the files are sorted into DIR/1, DIR/2, ... of at most
# 64 MiB each, what one transfer to the GPU machine carries; the script lists what it fetched, the sizes, and each
# folder's files. The folders are a download cache: never commit them.
set -euo pipefail
dir=${1:?usage: benchmarks/prepare_wheels.sh DIR PYTHON_VERSION CUDA_MAJOR  (e.g. benchmarks/wheels 3.12 13)}
python_version=${2:?usage: benchmarks/prepare_wheels.sh DIR PYTHON_VERSION CUDA_MAJOR  (e.g. benchmarks/wheels 3.12 13)}
cuda=${3:?usage: benchmarks/prepare_wheels.sh DIR PYTHON_VERSION CUDA_MAJOR  (e.g. benchmarks/wheels 3.12 13)}
exec python "$(dirname "$0")/_wheels.py" fetch "$dir" --python "$python_version" --cuda "$cuda"
