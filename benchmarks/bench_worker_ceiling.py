"""The rollout worker's ceiling: CPU per scored token of decoding vLLM's answers, and the trainer's side of the queue.

Part 1 (``decode``): bodies built with the exact JSON vLLM's OpenAI server sends (compact separators, every field
of a completion choice, ``prompt_logprobs`` with one entry per sequence token — ``null`` for the first, each
``{token_id_str: {"logprob", "rank", "decoded_token"}}``, K + 1 entries where the realised token is outside the
top-K — and the student's generation answer with ``token_ids`` and ``logprobs``), decoded per rollout (one student
and one teacher answer) with each decoding choice, side by side in one run:

- ``json``: ``json.loads`` + :func:`~fastdistill.rollout.parse_prompt_logprobs` (the client's path today);
- ``json+flat``: ``json.loads`` + :func:`~fastdistill.rollout.decode.scores_from_prompt_logprobs` (rows flattened
  once, sorted by numpy; the one-line change in the client);
- ``orjson``: ``orjson.loads`` + the same parser;
- ``orjson+flat``: ``orjson.loads`` + :func:`~fastdistill.rollout.decode.scores_from_prompt_logprobs`;
- ``msgspec``: :func:`~fastdistill.rollout.decode.scores_from_body` on the raw bytes (prompt rows skipped as
  ``msgspec.Raw``, completion rows into typed structs) and a typed struct for the student's answer;
- ``msgspec+compact``: the same student answer, and the teacher's scores as fastdistill's scoring plugin answers
  (one base64 float32 matrix of the completion rows, :func:`~fastdistill.rollout.decode.scores_from_compact_body`).

CPU time (``time.process_time``, so other load on the machine inflates it less than wall time): median of rounds,
in µs per scored token (completion token with teacher candidates); tokens/s = 1e6 / that, per process, decoding
only (the HTTP client's own cost comes on top: see bench_rollout.py's stub part). Every choice's TeacherScores are
checked equal to the reference's.

Part 2 (``trainer``): the trainer's side of the queue: a producer process puts pickled samples into a
multiprocessing queue, the trainer's process takes them through :class:`~fastdistill.train.source.WorkerSource`
(``next``: unpickling, staleness) and packs a step's worth with :func:`~fastdistill.data.packing.pack_row`; CPU µs
per completion token of the consumer, with ``--torch-threads`` intra-op threads (default 1, as bench_e2e.py runs the
trainer: on a shared 2-core machine torch's thread pool spinning against other load makes pack_row's small tensor ops
ten times slower).

Part 3 (``workers``): the whole rollout path with ``rollout_processes`` = 1, 2, … side by side in one run: a
:class:`~fastdistill.rollout.RolloutWorker` against an instant stub server (a separate process answering with the
part-1 bodies at ``--workers-top-k``, ``--workers-length``, ``--workers-prompt-length``) and the trainer's side
taking its samples through :class:`~fastdistill.train.source.WorkerSource` and
:class:`~fastdistill.train.collector.WindowCollector` into a batcher (and draining the metrics queue, as the
trainer does every step). Per process count: scored tokens/s (wall), the children's CPU µs per scored token (which
gives one process's ceiling, 1e6 / that), how busy each child was (CPU s / wall s), the trainer side's CPU µs per
token and the stub's. The projection: processes (= cores) for 200k scored tokens/s at the children's CPU per token.

    python benchmarks/bench_worker_ceiling.py                         # full grid, tables + JSON
    python benchmarks/bench_worker_ceiling.py --top-k 8 --lengths 16 --prompt-lengths 8 --min-round-s 0.01
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import multiprocessing as mp
import os
import platform
import statistics
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import orjson

from fastdistill.rollout import RolloutSample, TeacherScores, parse_prompt_logprobs
from fastdistill.rollout.decode import scores_from_body, scores_from_compact_body, scores_from_prompt_logprobs

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "bench_worker_ceiling.json"
VOCAB = 151_936  # a Qwen-sized vocabulary: token ids of 1 to 6 digits
TARGET_TOK_S = 200_000  # scored tokens/s a node of 8 GPUs generates with a small student: the rollout path's goal
OUTSIDE_TOP_K = 0.3  # share of positions whose realised token is outside the teacher's top-K (K + 1 entries)


# ------------------------------------------------------------------------------------------------------ bodies
def _decoded(token: int) -> str:
    return f"\u0120w{token % 9973}"  # a byte-level BPE piece as vLLM decodes it ("Ġ" + letters)


def _completion_envelope(choice: dict, prompt_length: int, completion_tokens: int) -> bytes:
    """A full ``/v1/completions`` answer around ``choice`` as vLLM serialises it (Starlette's compact JSON)."""
    body = {
        "id": "cmpl-8d1f0c0e6f2a4b5c9e7d3a1b2c4d6e8f",
        "object": "text_completion",
        "created": 1764547200,
        "model": "teacher",
        "choices": [choice],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": {"prompt_tokens": prompt_length, "total_tokens": prompt_length + completion_tokens,
                  "completion_tokens": completion_tokens, "prompt_tokens_details": None},
        "kv_transfer_params": None,
    }
    return json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def teacher_body(prompt_length: int, completion_length: int, top_k: int, seed: int = 0) -> tuple[bytes, list[int]]:
    """(the teacher's scoring answer, the sequence it scored): ``prompt_logprobs=top_k`` over prompt + completion
    with ``max_tokens=1``. Log-probs are float32 values as vLLM reports them; ranks 1..K for the top-K and a rank
    beyond K for a realised token outside it."""
    rng = np.random.default_rng(seed)
    sequence = rng.integers(0, VOCAB, size=prompt_length + completion_length).tolist()
    entries: list[dict | None] = [None]
    for position in range(1, len(sequence)):
        realised = sequence[position]
        top = rng.choice(VOCAB, size=top_k, replace=False).tolist()
        logprobs = np.sort(-6 * rng.random(top_k + 1).astype(np.float32) ** 2)[::-1].tolist()
        if realised in top or rng.random() >= OUTSIDE_TOP_K:
            if realised not in top:
                top[int(rng.integers(top_k))] = realised
            ranked = [(token, rank + 1) for rank, token in enumerate(top)]
        else:
            ranked = [(token, rank + 1) for rank, token in enumerate(top)] + [(realised, top_k + 1 + int(
                rng.integers(1, 5000)))]
        # vLLM lists the realised token first, then the top-K in rank order
        realised_first = sorted(ranked, key=lambda item: item[0] != realised)
        entries.append({str(token): {"logprob": logprobs[min(rank - 1, top_k)], "rank": rank,
                                     "decoded_token": _decoded(token)} for token, rank in realised_first})
    choice = {"index": 0, "text": _decoded(7), "logprobs": None, "finish_reason": "length", "stop_reason": None,
              "token_ids": None, "prompt_logprobs": entries, "prompt_token_ids": None}
    return _completion_envelope(choice, len(sequence), 1), sequence


def student_body(completion: list[int], prompt_length: int, seed: int = 0) -> bytes:
    """The student's generation answer for ``completion`` (``logprobs=0``, ``return_token_ids``)."""
    rng = np.random.default_rng(seed + 1)
    logprobs = (-3 * rng.random(len(completion)).astype(np.float32)).tolist()
    pieces = [_decoded(token) for token in completion]
    offsets = np.cumsum([0] + [len(piece) for piece in pieces[:-1]]).tolist()
    choice = {"index": 0, "text": "".join(pieces),
              "logprobs": {"text_offset": offsets, "token_logprobs": logprobs, "tokens": pieces,
                           "top_logprobs": [{piece: lp} for piece, lp in zip(pieces, logprobs, strict=True)]},
              "finish_reason": "length", "stop_reason": None, "token_ids": completion, "prompt_logprobs": None,
              "prompt_token_ids": None}
    return _completion_envelope(choice, prompt_length, len(completion))


# ------------------------------------------------------------------------------------------------------ decoders
class _StudentLogprobs(msgspec.Struct, gc=False):
    token_logprobs: list[float]


class _StudentChoice(msgspec.Struct, gc=False):
    token_ids: list[int]
    logprobs: _StudentLogprobs


class _StudentBody(msgspec.Struct, gc=False):
    choices: list[_StudentChoice]


_STUDENT_DECODER = msgspec.json.Decoder(_StudentBody)


def _student_arrays(choice: dict) -> tuple[np.ndarray, np.ndarray]:
    return (np.asarray(choice["token_ids"], dtype=np.int32),
            np.asarray(choice["logprobs"]["token_logprobs"], dtype=np.float32))


def decoders(prompt_length: int, completion_length: int, top_k: int) -> dict[str, Callable[[bytes, bytes], Any]]:
    """Each decoding choice: (student body, teacher body) -> (token ids, log-probs, TeacherScores)."""

    def with_loads(loads: Callable[[bytes], Any], parse: Callable[..., TeacherScores]):
        def decode(student: bytes, teacher: bytes):
            ids, logprobs = _student_arrays(loads(student)["choices"][0])
            per_position = loads(teacher)["choices"][0].get("prompt_logprobs")
            return ids, logprobs, parse("bench", per_position, prompt_length, completion_length, top_k)

        return decode

    def with_msgspec(student: bytes, teacher: bytes):
        choice = _STUDENT_DECODER.decode(student).choices[0]
        ids = np.asarray(choice.token_ids, dtype=np.int32)
        logprobs = np.asarray(choice.logprobs.token_logprobs, dtype=np.float32)
        return ids, logprobs, scores_from_body("bench", teacher, prompt_length, completion_length, top_k)

    compact_bodies: dict[bytes, bytes] = {}  # the scoring plugin's answer for the same scores, built once per body

    def with_compact(student: bytes, teacher: bytes):
        from bench_scoring_reply import compact_body  # it imports this module

        compact = compact_bodies.get(teacher)
        if compact is None:
            compact = compact_bodies.setdefault(teacher, compact_body(teacher, prompt_length, top_k, None))
        choice = _STUDENT_DECODER.decode(student).choices[0]
        ids = np.asarray(choice.token_ids, dtype=np.int32)
        logprobs = np.asarray(choice.logprobs.token_logprobs, dtype=np.float32)
        return ids, logprobs, scores_from_compact_body("bench", compact, ids, top_k, 0)

    return {"json": with_loads(json.loads, parse_prompt_logprobs),
            "json+flat": with_loads(json.loads, scores_from_prompt_logprobs),
            "orjson": with_loads(orjson.loads, parse_prompt_logprobs),
            "orjson+flat": with_loads(orjson.loads, scores_from_prompt_logprobs),
            "msgspec": with_msgspec,
            "msgspec+compact": with_compact}


def cpu_s_per_call(function: Callable[[], Any], min_round_s: float, rounds: int = 3) -> float:
    """Median over ``rounds`` of the CPU seconds per call, each round calling until ``min_round_s`` CPU passed."""
    measured = []
    for _ in range(rounds):
        calls, started = 0, time.process_time()
        while True:
            function()
            calls += 1
            spent = time.process_time() - started
            if spent >= min_round_s:
                break
        measured.append(spent / calls)
    return statistics.median(measured)


def same_outputs(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in ((a[0], b[0]), (a[1], b[1]), (a[2].candidate_ids, b[2].candidate_ids),
                                                   (a[2].logprobs, b[2].logprobs)))


def bench_decode(top_ks: list[int], lengths: list[int], prompt_lengths: list[int], min_round_s: float) -> list[dict]:
    """One row per (K, L, P): body sizes and, per decoder, CPU µs per scored token and whether it agrees."""
    rows = []
    for top_k in top_ks:
        for completion_length, prompt_length in zip(lengths, prompt_lengths, strict=True):
            teacher, sequence = teacher_body(prompt_length, completion_length, top_k)
            student = student_body(sequence[prompt_length:], prompt_length)
            choices = decoders(prompt_length, completion_length, top_k)
            reference = choices["json"](student, teacher)
            row: dict[str, Any] = {"top_k": top_k, "completion_length": completion_length,
                                   "prompt_length": prompt_length, "teacher_body_mb": len(teacher) / 2**20,
                                   "student_body_kb": len(student) / 2**10, "us_per_token": {}, "agrees": {}}
            for name, decode in choices.items():
                row["agrees"][name] = same_outputs(decode(student, teacher), reference)
                seconds = cpu_s_per_call(lambda d=decode, s=student, t=teacher: d(s, t), min_round_s)
                row["us_per_token"][name] = seconds / completion_length * 1e6
            rows.append(row)
            print(f"  K={top_k} L={completion_length} P={prompt_length}: "
                  + ", ".join(f"{k} {v:.2f}" for k, v in row["us_per_token"].items()) + " µs/token", flush=True)
    return rows


# ------------------------------------------------------------------------------------------------------ trainer side
def _sample(prompt_length: int, completion_length: int, top_k: int, prompt_id: int) -> RolloutSample:
    rng = np.random.default_rng(prompt_id)
    return RolloutSample(
        input_ids=rng.integers(0, VOCAB, prompt_length + completion_length).astype(np.int32),
        completion_mask=np.r_[np.zeros(prompt_length, np.int32), np.ones(completion_length, np.int32)],
        teacher_topk_ids=rng.integers(0, VOCAB, (completion_length, top_k + 1)).astype(np.int32),
        teacher_topk_logprobs=-rng.random((completion_length, top_k + 1)).astype(np.float32),
        rollout_logprobs=-rng.random(completion_length).astype(np.float32),
        model_version=0, teacher_id="t", prompt_id=prompt_id, dataset_index=prompt_id)


def _produce(samples, count: int, prompt_length: int, completion_length: int, top_k: int) -> None:
    for prompt_id in range(count):
        samples.put(_sample(prompt_length, completion_length, top_k, prompt_id))


class _QueueWorker:
    """What WorkerSource needs of a RolloutWorker: its sample queue and a health check."""

    def __init__(self, samples):
        self.samples = samples

    def check_health(self, stale_after_s: float) -> None:
        pass


def bench_trainer_side(top_k: int, completion_length: int, prompt_length: int, steps: int,
                       samples_per_step: int) -> dict:
    """Consumer CPU µs per completion token of WorkerSource.next and of pack_row, samples from another process
    (one warm-up sample, then ``steps`` steps of ``samples_per_step`` samples)."""
    from fastdistill.data.packing import pack_row
    from fastdistill.train.source import WorkerSource

    context = mp.get_context("spawn")
    samples = context.Queue(maxsize=4 * samples_per_step)
    producer = context.Process(target=_produce, daemon=True,
                               args=(samples, steps * samples_per_step + 1, prompt_length, completion_length, top_k))
    producer.start()
    try:
        source = WorkerSource(_QueueWorker(samples), max_staleness=4, stale_policy="drop",
                              heartbeat_stale_after_s=600.0)
        source.next(0)  # the producer is running
        next_cpu = pack_cpu = 0.0
        for _ in range(steps):
            started = time.process_time()
            batch = [source.next(0) for _ in range(samples_per_step)]
            next_cpu += time.process_time() - started
            started = time.process_time()
            pack_row(batch, ["t"], vocab_size=VOCAB)
            pack_cpu += time.process_time() - started
    finally:
        producer.join(60)
        if producer.is_alive():
            producer.terminate()
    tokens = steps * samples_per_step * completion_length
    return {"top_k": top_k, "completion_length": completion_length, "prompt_length": prompt_length, "steps": steps,
            "samples_per_step": samples_per_step, "next_us_per_token": next_cpu / tokens * 1e6,
            "pack_us_per_token": pack_cpu / tokens * 1e6}


# ------------------------------------------------------------------------------------------------------ workers
def _stub_bodies(top_k: int, completion_length: int, prompt_length: int) -> tuple[bytes, bytes, list[int]]:
    """(student body, teacher body, prompt ids): one rollout's answers, replayed for every request."""
    teacher, sequence = teacher_body(prompt_length, completion_length, top_k)
    return student_body(sequence[prompt_length:], prompt_length), teacher, sequence[:prompt_length]


def bench_workers(processes: list[int], top_k: int, completion_length: int, prompt_length: int, samples: int,
                  warmup: int, inflight: int, samples_per_step: int, repeats: int = 1) -> list[dict]:
    """One row per (repeat, process count), the counts interleaved within each repeat: the worker against an
    instant stub, the trainer's side into a batcher."""
    from bench_rollout import STUB_MODEL, process_cpu_s, serve_stub

    from fastdistill.data.batching import FixedCountBatcher
    from fastdistill.rollout import RolloutConfig, RolloutWorker
    from fastdistill.serve import free_port
    from fastdistill.train.checkpoint import RolloutState
    from fastdistill.train.collector import WindowCollector
    from fastdistill.train.source import WorkerSource

    student, teacher, prompt = _stub_bodies(top_k, completion_length, prompt_length)
    context = mp.get_context("spawn")
    ports = (free_port(), free_port())
    ready = context.Event()
    stub = context.Process(target=serve_stub, args=(ports, (student, teacher), ready), daemon=True)
    stub.start()
    rows = []
    try:
        if not ready.wait(60):
            raise RuntimeError("the stub server did not start within 60 s")
        for repeat, count in itertools.product(range(repeats), processes):
            config = RolloutConfig(f"http://127.0.0.1:{ports[0]}", {"t": f"http://127.0.0.1:{ports[1]}"},
                                   teacher_top_k=top_k, max_tokens=completion_length, max_inflight_tasks=inflight,
                                   student_model=STUB_MODEL, rollout_processes=count)
            worker = RolloutWorker(config, [{"prompt_ids": prompt}] * 64, queue_maxsize=4 * samples_per_step)
            worker.start()
            try:
                source = WorkerSource(worker, max_staleness=4, stale_policy="drop", heartbeat_stale_after_s=600.0)
                collector = WindowCollector(total_prompts=None, world_size=1, microbatches_per_step=1,
                                            make_batcher=lambda: FixedCountBatcher(samples_per_step, 1),
                                            state=RolloutState())
                steps = -(-samples // samples_per_step)
                for _ in range(-(-warmup // samples_per_step)):
                    collector.mark_trained(collector.collect(source, 0))
                source.drain_worker_metrics()
                pids = worker.pids
                children_cpu = [process_cpu_s(pid) for pid in pids]
                stub_cpu = process_cpu_s(stub.pid)
                parent_cpu, started = time.process_time(), time.perf_counter()
                for _ in range(steps):
                    window = collector.collect(source, 0)
                    collector.mark_trained(window)
                    source.drain_worker_metrics()
                elapsed = time.perf_counter() - started
                parent_cpu = time.process_time() - parent_cpu
                children_cpu = [process_cpu_s(pid) - cpu for pid, cpu in zip(pids, children_cpu, strict=True)]
                stub_cpu = process_cpu_s(stub.pid) - stub_cpu
                worker.check_health(stale_after_s=600.0)
            finally:
                worker.stop()
            tokens = steps * samples_per_step * completion_length
            child_us = sum(children_cpu) / tokens * 1e6
            rows.append({"repeat": repeat, "processes": count, "top_k": top_k, "completion_length": completion_length,
                         "prompt_length": prompt_length, "samples": steps * samples_per_step, "seconds": elapsed,
                         "tok_s": tokens / elapsed, "child_us_per_token": child_us,
                         "child_busy": [cpu / elapsed for cpu in children_cpu],
                         "trainer_side_us_per_token": parent_cpu / tokens * 1e6,
                         "stub_us_per_token": stub_cpu / tokens * 1e6,
                         "processes_for_target": math.ceil(TARGET_TOK_S * child_us / 1e6)})
            print(f"  P={count}: {tokens / elapsed / 1e3:.1f}k tok/s, children {child_us:.2f} µs/token, trainer "
                  f"side {parent_cpu / tokens * 1e6:.3f} µs/token", flush=True)
    finally:
        stub.terminate()
        stub.join(5)
    return rows


# ------------------------------------------------------------------------------------------------------ report
def machine() -> dict:
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = float("nan")
    return {"date_utc": datetime.now(UTC).strftime("%Y-%m-%d %H:%M"), "cpus": os.cpu_count(),
            "platform": platform.platform(), "python": platform.python_version(), "loadavg_1min_at_start": load,
            "msgspec": msgspec.__version__, "orjson": orjson.__version__}


def print_tables(result: dict) -> None:
    names = list(result["decode"][0]["us_per_token"]) if result["decode"] else []
    if names:
        _print_decode_table(result, names)
    if result["trainer"]:
        _print_trainer_table(result)
    if result["workers"]:
        _print_workers_table(result)


def _print_decode_table(result: dict, names: list[str]) -> None:
    print("\nDecoding one rollout's answers (student + teacher), CPU µs per scored token (tokens/s per process)")
    print("| K | L | P | teacher MB | " + " | ".join(names) + " | json / best | cores for 200k tok/s: json, best "
          "| all agree |")
    print("|---:|---:|---:|---:|" + "---:|" * len(names) + "---:|---:|:---:|")
    for row in result["decode"]:
        cost = row["us_per_token"]
        cells = [f"{cost[name]:.2f} ({1e6 / cost[name] / 1e3:.0f}k)" for name in names]
        print(f"| {row['top_k']} | {row['completion_length']} | {row['prompt_length']} | "
              f"{row['teacher_body_mb']:.2f} | " + " | ".join(cells)
              + f" | {cost['json'] / min(cost.values()):.1f}× | {TARGET_TOK_S * cost['json'] / 1e6:.1f}, "
              f"{TARGET_TOK_S * min(cost.values()) / 1e6:.1f} | {'yes' if all(row['agrees'].values()) else 'NO'} |")


def _print_trainer_table(result: dict) -> None:
    print("\nThe trainer's side of the queue, CPU µs per completion token")
    print("| K | L | P | samples/step | WorkerSource.next | pack_row | total |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for row in result["trainer"]:
        total = row["next_us_per_token"] + row["pack_us_per_token"]
        print(f"| {row['top_k']} | {row['completion_length']} | {row['prompt_length']} | {row['samples_per_step']} | "
              f"{row['next_us_per_token']:.3f} | {row['pack_us_per_token']:.3f} | {total:.3f} |")


def _median_rows(rows: list[dict]) -> list[dict]:
    """Per process count, the median over repeats of every number (busy: per child)."""
    merged = []
    for count in dict.fromkeys(row["processes"] for row in rows):
        group = [row for row in rows if row["processes"] == count]
        row = dict(group[0])
        for key, value in row.items():
            if isinstance(value, float):
                row[key] = statistics.median(r[key] for r in group)
        row["child_busy"] = [statistics.median(r["child_busy"][i] for r in group) for i in range(count)]
        row["processes_for_target"] = math.ceil(TARGET_TOK_S * row["child_us_per_token"] / 1e6)
        row["repeats"] = len(group)
        merged.append(row)
    return merged


def _print_workers_table(result: dict) -> None:
    rows = _median_rows(result["workers"])
    first = rows[0]
    print(f"\nThe rollout path with P worker processes against an instant stub (K={first['top_k']}, "
          f"L={first['completion_length']}, prompt {first['prompt_length']}): scored tokens/s and CPU per token, "
          f"medians of {first['repeats']} interleaved repeats")
    print("| | " + " | ".join(f"P = {row['processes']}" for row in rows) + " |")
    print("|---|" + "---:|" * len(rows))
    cells = {
        "scored tok/s (wall)": [f"{row['tok_s'] / 1e3:.1f}k" for row in rows],
        "children CPU µs / token": [f"{row['child_us_per_token']:.2f}" for row in rows],
        "one process's ceiling, tok/s (1e6 / that)": [
            f"{1e6 / row['child_us_per_token'] / 1e3:.1f}k" if row["child_us_per_token"] else "n/a (under a tick)"
            for row in rows],
        "each child busy (CPU s / wall s)": [" / ".join(f"{busy:.2f}" for busy in row["child_busy"]) for row in rows],
        "children together busy": [f"{sum(row['child_busy']):.2f}" for row in rows],
        "trainer side CPU µs / token": [f"{row['trainer_side_us_per_token']:.3f}" for row in rows],
        "stub server CPU µs / token": [f"{row['stub_us_per_token']:.2f}" for row in rows],
        f"processes for {TARGET_TOK_S // 1000}k tok/s": [str(row["processes_for_target"]) for row in rows],
    }
    for name, values in cells.items():
        print(f"| {name} | " + " | ".join(values) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--top-k", type=int, nargs="+", default=[8, 32, 128])
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096], help="completion lengths")
    parser.add_argument("--prompt-lengths", type=int, nargs="+", default=[128, 256, 512],
                        help="prompt length of each completion length")
    parser.add_argument("--min-round-s", type=float, default=0.3, help="CPU seconds per timing round (3 rounds)")
    parser.add_argument("--trainer-steps", type=int, default=8)
    parser.add_argument("--samples-per-step", type=int, default=8)
    parser.add_argument("--torch-threads", type=int, default=1, help="torch intra-op threads for the trainer part")
    parser.add_argument("--parts", nargs="+", choices=("decode", "trainer", "workers"),
                        default=["decode", "trainer", "workers"])
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2], help="rollout_processes (workers part)")
    parser.add_argument("--workers-top-k", type=int, default=32)
    parser.add_argument("--workers-length", type=int, default=1024, help="completion length of the workers part")
    parser.add_argument("--workers-prompt-length", type=int, default=256)
    parser.add_argument("--workers-samples", type=int, default=96, help="samples measured per process count")
    parser.add_argument("--workers-warmup", type=int, default=16)
    parser.add_argument("--workers-inflight", type=int, default=32, help="max_inflight_tasks, all processes together")
    parser.add_argument("--workers-repeats", type=int, default=3, help="interleaved repeats of the process counts")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write the results")
    args = parser.parse_args()
    if len(args.prompt_lengths) != len(args.lengths):
        parser.error("give one prompt length per completion length")

    if "trainer" in args.parts:
        import torch

        torch.set_num_threads(args.torch_threads)
    result: dict = {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()}, "decode": [],
                    "trainer": [], "workers": []}
    if "decode" in args.parts:
        result["decode"] = bench_decode(args.top_k, args.lengths, args.prompt_lengths, args.min_round_s)
    if "trainer" in args.parts:
        result["trainer"] = [bench_trainer_side(top_k, length, prompt, args.trainer_steps, args.samples_per_step)
                             for top_k in args.top_k
                             for length, prompt in zip(args.lengths, args.prompt_lengths, strict=True)]
    if "workers" in args.parts:
        result["workers"] = bench_workers(args.processes, args.workers_top_k, args.workers_length,
                                          args.workers_prompt_length, args.workers_samples, args.workers_warmup,
                                          args.workers_inflight, args.samples_per_step, args.workers_repeats)
    print_tables(result)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
