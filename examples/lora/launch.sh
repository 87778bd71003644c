#!/usr/bin/env bash
# Student on GPU 0, teacher (tensor-parallel) on GPUs 1-4, trainer on GPUs 5-7. Run from this folder.
set -euo pipefail
CUDA_VISIBLE_DEVICES=0 fastdistill serve-student Qwen/Qwen2.5-7B-Instruct --port 8000 --dtype bfloat16 --enable-lora --max-lora-rank 64 &
CUDA_VISIBLE_DEVICES=1,2,3,4 fastdistill serve-teacher Qwen/Qwen2.5-32B-Instruct --port 8001 --dtype bfloat16 -- --tensor-parallel-size 4 &
CUDA_VISIBLE_DEVICES=5,6,7 torchrun --nproc-per-node 3 -m fastdistill.cli train --config config.yaml
