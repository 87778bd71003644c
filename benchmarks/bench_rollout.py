"""Rollout throughput: the worker against real vLLM servers, and its own overhead against an instant stub server.

Part 1 (``vllm``): builds a tiny student and a tiny teacher (``fastdistill.tiny``, same tokenizer), starts a real
vLLM server for each (``fastdistill.serve.VLLMServer``; vLLM from ``$FASTDISTILL_VLLM_PYTHON``), and runs the
:class:`RolloutWorker` with 1, 8 and 32 rollouts in flight: samples/s and scored tokens/s (completion tokens that
came back with teacher candidates) over ``--samples`` samples after a warm-up.

Part 2 (``stub``): the worker's own cost per sample, measured against a stub server (a separate process answering
precomputed vLLM-shaped bodies at once, ``--max-tokens`` completion tokens and K+1 candidates per position):
- parse: JSON decode + array building of one student answer and one teacher answer, in-process (CPU time);
- pickle: ``pickle.dumps`` + ``loads`` of one RolloutSample, in-process (what crosses the process boundary; CPU);
- child CPU per sample: the worker process's CPU time (HTTP client, parsing, queue put, pickling) over the run;
- parent CPU per sample: the consumer's CPU time for ``samples.get`` (unpickling);
- end-to-end samples/s against the stub (the ceiling the worker imposes on a 2-core machine).

    python benchmarks/bench_rollout.py                       # both parts, table + benchmarks/results/bench_rollout.json
    python benchmarks/bench_rollout.py --stub-only --samples 200 --json /tmp/rollout.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import pickle
import platform
import queue
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

# fastdistill_testing (the test harness: at the repository root, not installed with the wheel)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastdistill.rollout import RetryPolicy, RolloutConfig, RolloutSample, RolloutWorker, parse_prompt_logprobs

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "bench_rollout.json"
PROMPT_LENGTH = 24  # stub prompts
STUB_MODEL = "stub-model"


# ------------------------------------------------------------------------------------------------------ stub part
def stub_bodies(max_tokens: int, top_k: int) -> tuple[bytes, bytes]:
    """(student body, teacher body) as vLLM would send them for a PROMPT_LENGTH prompt and a full-length completion."""
    rng = np.random.default_rng(0)
    completion = rng.integers(3, 500, size=max_tokens).tolist()
    student = {
        "id": "cmpl-stub",
        "object": "text_completion",
        "model": STUB_MODEL,
        "choices": [
            {
                "index": 0,
                "text": " x" * max_tokens,
                "token_ids": completion,
                "logprobs": {"token_logprobs": (-rng.random(max_tokens)).tolist(), "tokens": ["x"] * max_tokens},
                "finish_reason": "length",
            }
        ],
        "usage": {"prompt_tokens": PROMPT_LENGTH, "completion_tokens": max_tokens},
    }
    entries: list[dict | None] = [None]
    for _ in range(PROMPT_LENGTH + max_tokens - 1):
        ids = rng.choice(500, size=top_k + 1, replace=False)
        logprobs = np.sort(-3 * rng.random(top_k + 1))[::-1]
        entries.append(
            {
                str(int(token)): {"logprob": float(lp), "rank": rank + 1 if rank < top_k else 400, "decoded_token": "x"}
                for rank, (token, lp) in enumerate(zip(ids, logprobs, strict=True))
            }
        )
    teacher = {
        "id": "cmpl-stub",
        "choices": [{"index": 0, "text": "x", "token_ids": [1], "prompt_logprobs": entries, "finish_reason": "length"}],
    }
    return json.dumps(student).encode(), json.dumps(teacher).encode()


def serve_stub(ports: tuple[int, int], bodies: tuple[bytes, bytes], ready) -> None:
    """Stub server process: student answers on ports[0], teacher on ports[1], each its precomputed body at once."""
    import asyncio

    from aiohttp import web

    models = json.dumps({"data": [{"id": STUB_MODEL, "max_model_len": 4096}]}).encode()

    def app_for(body: bytes) -> web.Application:
        async def completions(request: web.Request) -> web.Response:
            await request.read()
            return web.Response(body=body, content_type="application/json")

        async def listing(request: web.Request) -> web.Response:
            return web.Response(body=models, content_type="application/json")

        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        app.router.add_get("/v1/models", listing)
        return app

    async def main() -> None:
        for port, body in zip(ports, bodies, strict=True):
            runner = web.AppRunner(app_for(body), access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
        ready.set()
        await asyncio.Event().wait()

    asyncio.run(main())


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def time_per_call_us(function, repeats: int) -> float:
    """Median of 5 rounds of ``repeats`` calls, in CPU microseconds per call (CPU time: other load on the machine
    does not inflate it the way wall time would)."""
    rounds = []
    for _ in range(5):
        started = time.process_time()
        for _ in range(repeats):
            function()
        rounds.append((time.process_time() - started) / repeats * 1e6)
    return statistics.median(rounds)


def bench_stub(samples: int, max_tokens: int, top_k: int, inflight: int) -> dict:
    """The worker's own cost per sample against an instant stub server (see the module docstring)."""
    from fastdistill.serve import free_port

    student_body, teacher_body = stub_bodies(max_tokens, top_k)

    def parse_once() -> None:
        choice = json.loads(student_body)["choices"][0]
        np.asarray(choice["token_ids"], dtype=np.int32), np.asarray(choice["logprobs"]["token_logprobs"], np.float32)
        per_position = json.loads(teacher_body)["choices"][0]["prompt_logprobs"]
        parse_prompt_logprobs("stub", per_position, PROMPT_LENGTH, max_tokens, top_k)

    scores = parse_prompt_logprobs(
        "stub", json.loads(teacher_body)["choices"][0]["prompt_logprobs"], PROMPT_LENGTH, max_tokens, top_k
    )
    sample = RolloutSample(
        input_ids=np.arange(PROMPT_LENGTH + max_tokens, dtype=np.int32),
        completion_mask=np.r_[np.zeros(PROMPT_LENGTH, np.int32), np.ones(max_tokens, np.int32)],
        teacher_topk_ids=scores.candidate_ids,
        teacher_topk_logprobs=scores.logprobs,
        rollout_logprobs=np.zeros(max_tokens, np.float32),
        model_version=0,
        teacher_id="t",
        prompt_id=0,
        dataset_index=0,
    )
    pickled = pickle.dumps(sample, protocol=pickle.HIGHEST_PROTOCOL)
    repeats = max(20, min(200, samples))
    result = {
        "max_tokens": max_tokens,
        "top_k": top_k,
        "inflight": inflight,
        "student_body_bytes": len(student_body),
        "teacher_body_bytes": len(teacher_body),
        "parse_us": time_per_call_us(parse_once, repeats),
        "pickle_us": time_per_call_us(lambda: pickle.loads(pickle.dumps(sample, pickle.HIGHEST_PROTOCOL)), repeats),
        "pickled_bytes": len(pickled),
    }

    context = mp.get_context("spawn")
    ports = (free_port(), free_port())
    ready = context.Event()
    stub = context.Process(target=serve_stub, args=(ports, (student_body, teacher_body), ready), daemon=True)
    stub.start()
    try:
        if not ready.wait(60):
            raise RuntimeError("the stub server did not start within 60 s")
        rows = [{"prompt_ids": list(range(1, PROMPT_LENGTH + 1))} for _ in range(64)]
        config = RolloutConfig(
            f"http://127.0.0.1:{ports[0]}",
            {"t": f"http://127.0.0.1:{ports[1]}"},
            teacher_top_k=top_k,
            max_tokens=max_tokens,
            max_inflight_tasks=inflight,
            student_model=STUB_MODEL,
        )
        worker = RolloutWorker(config, rows, queue_maxsize=256)
        worker.start()
        try:
            warmup = min(samples, 20)
            for _ in range(warmup):
                worker.samples.get(timeout=60)
            child_cpu, parent_cpu, started = process_cpu_s(worker.pid), time.process_time(), time.perf_counter()
            for _ in range(samples):
                worker.samples.get(timeout=60)
            elapsed = time.perf_counter() - started
            child_cpu = process_cpu_s(worker.pid) - child_cpu
            parent_cpu = time.process_time() - parent_cpu
            worker.check_health(stale_after_s=60.0)
        finally:
            worker.stop()
    finally:
        stub.terminate()
        stub.join(5)
    result.update(
        {
            "samples": samples,
            "seconds": elapsed,
            "samples_per_s": samples / elapsed,
            "child_cpu_ms_per_sample": child_cpu / samples * 1e3,
            "parent_cpu_us_per_sample": parent_cpu / samples * 1e6,
        }
    )
    return result


# ------------------------------------------------------------------------------------------------------ vLLM part
def build_checkpoints(folder: Path) -> tuple[Path, Path, list[list[int]]]:
    """Tiny student and teacher checkpoints (same tokenizer, different weights) and 64 chat prompts as token ids."""
    from fastdistill.tiny import build_model, build_tokenizer, save_pretrained_dir, tiny_config

    tokenizer = build_tokenizer()
    config = tiny_config(
        len(tokenizer), head_dim=32, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id
    )
    student = save_pretrained_dir(build_model(config, seed=0).float(), tokenizer, folder / "student")
    teacher = save_pretrained_dir(build_model(config, seed=1).float(), tokenizer, folder / "teacher")
    prompts = [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": f"Question {i}: what is {i} times {i + 3}?"}],
                add_generation_prompt=True,
                return_dict=False,
            )
        )
        for i in range(64)
    ]
    return student, teacher, prompts


def bench_vllm(inflights: list[int], samples: int, max_tokens: int, top_k: int) -> dict:
    """Samples/s and scored tokens/s through the worker against real tiny vLLM servers, per in-flight cap."""
    from fastdistill.serve import VLLMServer, vllm_python
    from fastdistill_testing.vllm_server import start_together

    with tempfile.TemporaryDirectory(prefix="bench-rollout-") as tmp:
        student_dir, teacher_dir, prompts = build_checkpoints(Path(tmp))
        servers = [
            VLLMServer(student_dir, role="student", log_path=Path(tmp) / "student.log"),
            VLLMServer(teacher_dir, role="teacher", log_path=Path(tmp) / "teacher.log"),
        ]
        started = time.perf_counter()
        start_together(*servers)  # launched from this thread: a server stops when the thread that launched it ends
        try:
            startup_s = time.perf_counter() - started
            print(f"vLLM servers up in {startup_s:.0f} s ({vllm_python()})", file=sys.stderr)
            rows = [{"prompt_ids": prompt} for prompt in prompts]
            runs = []
            for inflight in inflights:
                config = RolloutConfig(
                    servers[0].url,
                    {"t": servers[1].url},
                    teacher_top_k=top_k,
                    max_tokens=max_tokens,
                    max_inflight_tasks=inflight,
                    retry=RetryPolicy(request_timeout_s=120.0),
                )
                runs.append(run_worker(config, rows, inflight, samples))
                print(f"  inflight {inflight}: {runs[-1]['samples_per_s']:.2f} samples/s", file=sys.stderr)
        finally:
            for server in servers:
                server.stop()
    return {"server_startup_s": startup_s, "runs": runs}


def run_worker(config: RolloutConfig, rows: list[dict], inflight: int, samples: int) -> dict:
    """Warm up (``inflight`` samples, at least 4), then time ``samples`` samples."""
    worker = RolloutWorker(config, rows, queue_maxsize=1024)
    worker.start()
    try:
        deadline = time.monotonic() + 600
        for _ in range(max(4, inflight)):
            worker.check_health(stale_after_s=120.0)
            worker.samples.get(timeout=max(1.0, deadline - time.monotonic()))
        started = time.perf_counter()
        lengths = []
        while len(lengths) < samples:
            worker.check_health(stale_after_s=120.0)
            try:
                sample = worker.samples.get(timeout=1.0)
            except queue.Empty:
                assert time.monotonic() < deadline, "no samples for too long"
                continue
            lengths.append(int(sample.teacher_topk_ids.shape[0]))
        elapsed = time.perf_counter() - started
    finally:
        worker.stop()
    return {
        "inflight": inflight,
        "samples": samples,
        "seconds": elapsed,
        "samples_per_s": samples / elapsed,
        "scored_tok_per_s": sum(lengths) / elapsed,
        "mean_completion_len": sum(lengths) / len(lengths),
    }


# ------------------------------------------------------------------------------------------------------ report
def machine() -> dict:
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = float("nan")
    return {
        "date_utc": datetime.now(UTC).strftime("%Y-%m-%d %H:%M"),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "loadavg_1min_at_start": load,
    }


def print_tables(result: dict) -> None:
    if "vllm" in result:
        print(f"\nThrough the worker, real vLLM servers (startup {result['vllm']['server_startup_s']:.0f} s)")
        print("| in flight | samples | s | samples/s | scored tok/s | mean completion len |")
        print("|---:|---:|---:|---:|---:|---:|")
        for run in result["vllm"]["runs"]:
            print(
                f"| {run['inflight']} | {run['samples']} | {run['seconds']:.1f} | {run['samples_per_s']:.2f} | "
                f"{run['scored_tok_per_s']:.0f} | {run['mean_completion_len']:.1f} |"
            )
    stub = result["stub"]
    print(f"\nWorker overhead per sample against an instant stub (L={stub['max_tokens']}, K={stub['top_k']})")
    print("| parse µs | pickle+unpickle µs | pickled KB | child CPU ms | parent CPU µs | samples/s (stub) |")
    print("|---:|---:|---:|---:|---:|---:|")
    print(
        f"| {stub['parse_us']:.0f} | {stub['pickle_us']:.0f} | {stub['pickled_bytes'] / 1024:.1f} | "
        f"{stub['child_cpu_ms_per_sample']:.2f} | {stub['parent_cpu_us_per_sample']:.0f} | "
        f"{stub['samples_per_s']:.0f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stub-only", action="store_true", help="skip the real vLLM part")
    parser.add_argument("--inflight", type=int, nargs="+", default=[1, 8, 32], help="in-flight caps (vLLM part)")
    parser.add_argument("--samples", type=int, default=64, help="timed samples per measurement")
    parser.add_argument("--stub-samples", type=int, default=500, help="timed samples against the stub")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write the results")
    args = parser.parse_args()

    result: dict = {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()}}
    if not args.stub_only:
        result["vllm"] = bench_vllm(args.inflight, args.samples, args.max_tokens, args.top_k)
    result["stub"] = bench_stub(args.stub_samples, args.max_tokens, args.top_k, inflight=32)
    print_tables(result)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
