#!/usr/bin/env bash
# The GPU check: run every CUDA path of treeattn on a machine with an NVIDIA GPU.
#
#   benchmarks/gpu_check.sh [MODEL.gguf|debug] [STAGES TO SKIP...]
#
# It expects a python3 that has torch with CUDA and triton, plus treeattn's planner and llm
# dependencies (simpy, gguf, tokenizers, ...), and runs treeattn from this checkout without
# installing it. MODEL is the SmolLM2 GGUF (default: the debug model, which has random
# weights). Results go to benchmarks/results/{gpu-check,kernels,decode-step}-h200.{json,md};
# see benchmarks/gpu_check.py for the stages. The whole check stops after GPU_CHECK_LIMIT_S
# seconds (default 420), so a hang cannot eat a machine's lease.
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
MODEL=${1:-debug}
shift || true
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.memory \
    --format=csv || echo "error: nvidia-smi found no GPU"
python3 -c "import torch, triton, simpy, gguf, tokenizers, treeattn; \
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, \
'gpu', torch.cuda.get_device_name() if torch.cuda.is_available() else None)" || exit 2
SKIP=()
if [ $# -gt 0 ]; then SKIP=(--skip "$@"); fi
timeout "${GPU_CHECK_LIMIT_S:-420}" python3 benchmarks/gpu_check.py --model "$MODEL" \
    --tag h200 "${SKIP[@]}"
