#!/usr/bin/env bash
# One-call GPU check (see benchmarks/gpu_check.py): bash benchmarks/gpu_check.sh [--dry-run] [--json PATH] ...
# Needs only a Python >= 3.11 (PYTHON=..., default python3); everything else is installed into .venv-gpu-check.
set -euo pipefail
exec "${PYTHON:-python3}" "$(dirname "${BASH_SOURCE[0]}")/gpu_check.py" "$@"
