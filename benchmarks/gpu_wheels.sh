#!/usr/bin/env bash
# Download, here, the wheels benchmarks/gpu.py needs on the GPU machine (nvidia-h200), into .whl/ (gitignored).
#
# That machine has no network. Its image already holds torch 2.11, transformers 5.17, tokenizers, safetensors,
# accelerate, peft, triton, numpy, pyarrow, pandas, pyyaml, fsspec, tqdm, xxhash, psutil, jinja2 and
# huggingface-hub (/work/.library/device/KINDS.md); it lacks what is pinned below:
#   posttrain's own:  pydantic, pydantic-core and their needs (annotated-types, typing-inspection, typing-extensions)
#   TRL's baseline:   trl, datasets and datasets' needs dill and multiprocess
#   model.liger:      liger-kernel (needs torch and triton only)
# transformers stays the image's 5.17 (posttrain needs transformers>=5). Versions are the ones the test
# environment runs (constraints.txt / .venv), one of each, all pure Python except pydantic-core.
# Usage: bash benchmarks/gpu_wheels.sh   (then carry .whl in the device call; benchmarks/README.md "GPU")
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
WHEELS=(
  pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing_extensions==4.16.0
  trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
  liger-kernel==0.8.5
)
rm -rf .whl && mkdir -p .whl
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${WHEELS[@]}"
count=$(ls .whl/*.whl | wc -l)
if [ "$count" -ne "${#WHEELS[@]}" ]; then
  echo "expected ${#WHEELS[@]} wheels in .whl/, got $count" >&2; exit 1
fi
du -sh .whl
