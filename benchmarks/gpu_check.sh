#!/usr/bin/env bash
# One-call GPU check (see benchmarks/gpu_check.py): bash benchmarks/gpu_check.sh [--kit DIR] [--dry-run] [--json PATH] ...
# Needs only a Python >= 3.11 (PYTHON=..., default python3). With --kit DIR (benchmarks/device_kit.py's wheels) it
# uses that python as it is, offline; without, everything is installed into .venv-gpu-check.
set -euo pipefail
exec "${PYTHON:-python3}" "$(dirname "${BASH_SOURCE[0]}")/gpu_check.py" "$@"
