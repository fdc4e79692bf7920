#!/usr/bin/env bash
# One device call's GPU checks, most important first, each under its own timeout so one hang costs only its slot
# (benchmarks/README.md, "GPU"). Run in the repo root on the GPU machine, `.whl` carried (benchmarks/gpu_wheels.sh):
#   1. the CUDA-only tests (the EP grouped GEMM against the per-expert loop, varlen flash attention, Liger);
#   2. benchmarks/moe.py --grouped-gemm: DeepSeek-V3-shaped local experts, grouped GEMM vs one matmul pair each;
#   3. the single-process MoE tests on CUDA (every packaged recipe on a tiny MoE, the router-loss accumulation
#      equivalence, the MoE model tests): the MoE path as training runs it, on the GPU;
#   4. benchmarks/gpu.py's training rows (GPU_ROWS) for what is left of GPU_BUDGET_S.
# Everything lands in $OUT (the device tool brings it back): one file per step.
set -uo pipefail
OUT=${OUT:-/tmp/gpu_checks}
BUDGET=${GPU_BUDGET_S:-500}
ROWS=${GPU_ROWS:-sft-1b-compile,trl-sft-1b,dpo-1b-compile,trl-dpo-1b,sft-1b-eager}
started=$SECONDS
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false TQDM_DISABLE=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch,transformers,pydantic;print('torch',torch.__version__,'transformers',transformers.__version__,'pydantic',pydantic.__version__,'cuda',torch.version.cuda)"
} > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
left() { echo $((BUDGET - (SECONDS - started))); }

echo "== 1. CUDA-only tests ($(left) s left)"
timeout 150 python3 -m pytest -q -p no:cacheprovider -rs -x --no-header \
  tests/train/test_expert_parallel.py::test_grouped_gemm_matches_one_matmul_pair_per_expert \
  tests/models/test_varlen_attention.py tests/models/test_liger.py > "$OUT/cuda_tests.txt" 2>&1
echo "exit $?" >> "$OUT/cuda_tests.txt"; tail -n 15 "$OUT/cuda_tests.txt"

echo "== 2. MoE grouped GEMM ($(left) s left)"
timeout 120 python3 benchmarks/moe.py --grouped-gemm > "$OUT/moe_grouped_gemm.json" 2> "$OUT/moe_grouped_gemm.err"
echo "exit $?"; tail -c 1500 "$OUT/moe_grouped_gemm.json"; tail -c 800 "$OUT/moe_grouped_gemm.err"

echo "== 3. single-process MoE tests on CUDA ($(left) s left)"
timeout 150 python3 -m pytest -q -p no:cacheprovider -rs --no-header tests/models/test_moe_models.py \
  "tests/train/test_moe_training.py::test_every_packaged_recipe_trains_a_tiny_moe" \
  "tests/train/test_moe_training.py::test_router_losses_keep_accumulation_equivalence" > "$OUT/moe_tests.txt" 2>&1
echo "exit $?" >> "$OUT/moe_tests.txt"; tail -n 25 "$OUT/moe_tests.txt"

budget=$(( $(left) - 20 ))
echo "== 4. benchmarks/gpu.py rows $ROWS (budget ${budget} s)"
if [ "$budget" -gt 120 ]; then
  timeout $((budget + 15)) python3 benchmarks/gpu.py --budget-s "$budget" --rows "$ROWS" --work-dir /tmp/gpubench \
    --out "$OUT/gpu_results.json" > "$OUT/gpu_line.json" 2> "$OUT/gpu_log.txt"
  echo "exit $?"; tail -n 20 "$OUT/gpu_log.txt"
else
  echo "skipped: ${budget} s left"
fi
echo "== done in $((SECONDS - started)) s"
