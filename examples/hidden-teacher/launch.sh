#!/usr/bin/env bash
# The three launch commands of the hidden-state teacher recipe (one node, 8 GPUs). Run from this folder.
set -euo pipefail
CUDA_VISIBLE_DEVICES=0 fastdistill serve-student Qwen/Qwen2.5-0.5B-Instruct --port 8000 --dtype bfloat16 &
CUDA_VISIBLE_DEVICES=1 fastdistill serve-teacher Qwen/Qwen2.5-7B-Instruct --signal hidden --port 8001 --dtype bfloat16 &
# (the trainer waits for both servers' /health, checks the served hidden width against the head, then trains)
CUDA_VISIBLE_DEVICES=2,3,4,5,6,7 torchrun --nproc-per-node 6 -m fastdistill.cli train --config config.yaml
