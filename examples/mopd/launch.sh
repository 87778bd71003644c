#!/usr/bin/env bash
# Student on GPU 0, math teacher replicas on GPUs 1-2, code teacher on GPU 3, trainer on GPUs 4-7.
set -euo pipefail
CUDA_VISIBLE_DEVICES=0 fastdistill serve-student Qwen/Qwen2.5-0.5B-Instruct --port 8000 --dtype bfloat16 &
CUDA_VISIBLE_DEVICES=1 fastdistill serve-teacher Qwen/Qwen2.5-Math-1.5B-Instruct --port 8001 --dtype bfloat16 &
CUDA_VISIBLE_DEVICES=2 fastdistill serve-teacher Qwen/Qwen2.5-Math-1.5B-Instruct --port 8002 --dtype bfloat16 &
CUDA_VISIBLE_DEVICES=3 fastdistill serve-teacher Qwen/Qwen2.5-Coder-1.5B-Instruct --port 8003 --dtype bfloat16 &
CUDA_VISIBLE_DEVICES=4,5,6,7 torchrun --nproc-per-node 4 -m fastdistill.cli train --config config.yaml
