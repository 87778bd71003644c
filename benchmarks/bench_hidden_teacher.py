"""Top-K against hidden-state teacher signal on the demo's task: the held-out full-vocabulary divergence after the
same training steps, and trained tokens per second.

One process, no servers (the teacher signal is computed with Hugging Face transformers, exactly what the two server
routes return: ``prompt_logprobs`` top-K, or the final hidden states that ``serve-teacher --signal hidden`` sends):

1. the demo's teacher is trained on its toy task and a fresh student built (``bench_cache_train.build_task``);
2. every training prompt gets one completion, the teacher's greedy answer (fixed, so both runs train on the same
   tokens and differ only in the teacher signal);
3. the student is distilled for ``--epochs`` epochs from those samples, once per signal: top-K at each K of
   ``--top-ks`` (``sparse_jsd_loss``: the K candidates, the realised token and a tail bucket) and hidden
   (``dense_teacher_jsd_loss`` with the teacher's head, bfloat16 rows as on the wire), same learning rate,
   batch, β and steps; trained tokens/s from each run's train_summary.json;
4. every trained student is measured on the held-out prompts' teacher answers: the full-vocabulary generalized JSD
   at β and the forward KL(teacher‖student), float64, per completion token.

The hidden route's cost on the wire and on the server is measured in docs/hidden-teacher.md; here only the
trainer's side counts.

    python benchmarks/bench_hidden_teacher.py --epochs 8 --top-ks 1 8 --json /tmp/bench_hidden.json
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import platform
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
DEFAULT_JSON = HERE / "results" / "bench_hidden_teacher.json"


def greedy_answer(model: torch.nn.Module, prompt: list[int], max_tokens: int, eos: int) -> list[int]:
    """The model's greedy completion of ``prompt`` (at most ``max_tokens`` tokens, ending at ``eos``)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=eos,
                             pad_token_id=eos, use_cache=True)
    return out[0, len(prompt):].tolist()


def make_samples(teacher: torch.nn.Module, prompts: list[list[int]], completions: list[list[int]], signal: str,
                 top_k: int = 8) -> list[Any]:
    """One :class:`RolloutSample` per prompt and its completion, scored top-K or as (bfloat16) hidden rows."""
    from fastdistill.rollout.client import Generation, TeacherScores
    from fastdistill.rollout.hidden import TeacherHiddenStates
    from fastdistill.rollout.sample import RolloutSample
    from fastdistill.testing.synthetic import score_completion

    samples = []
    for index, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        generation = Generation(np.asarray(completion, np.int32), np.zeros(len(completion), np.float32))
        if signal == "hidden":
            with torch.no_grad():
                hidden = teacher.model(torch.tensor([prompt + completion])).last_hidden_state[0]
            rows = hidden[len(prompt) - 1 : len(prompt) + len(completion) - 1].bfloat16()
            scores: Any = TeacherHiddenStates(rows)
        else:
            with torch.no_grad():
                ids, lps = score_completion(teacher, prompt, completion, top_k)
            scores = TeacherScores(candidate_ids=ids, logprobs=lps)
        samples.append(RolloutSample.assemble(prompt, generation, scores, model_version=0, teacher_id="default",
                                              prompt_id=index, dataset_index=index))
    return samples


def full_vocab_divergence(student_dir: Path, teacher: torch.nn.Module, prompts: list[list[int]],
                          completions: list[list[int]], beta: float) -> dict[str, float]:
    """Held-out generalized JSD at ``beta`` and forward KL(teacher‖student) over the full vocabulary, float64,
    nats per completion token."""
    from transformers import AutoModelForCausalLM

    from fastdistill.loss.dense import dense_teacher_jsd_loss

    student = AutoModelForCausalLM.from_pretrained(student_dir, dtype=torch.float64).eval()
    reference = copy.deepcopy(teacher).double().eval()
    sums = {"jsd": 0.0, "forward_kl": 0.0}
    tokens = 0
    with torch.no_grad():
        for prompt, completion in zip(prompts, completions, strict=True):
            if not completion:
                continue
            ids = torch.tensor([prompt + completion])
            rows = slice(len(prompt) - 1, len(prompt) + len(completion) - 1)
            hs = student.model(ids).last_hidden_state[0, rows]
            ht = reference.model(ids).last_hidden_state[0, rows]
            for name, b in (("jsd", beta), ("forward_kl", 0.0)):
                out = dense_teacher_jsd_loss(hs, student.lm_head.weight, ht, reference.lm_head.weight, beta=b,
                                             backend="reference")
                sums[name] += float(out.jsd_sum)
            tokens += len(completion)
    return {f"held_out_{name}": value / max(tokens, 1) for name, value in sums.items()} | {"held_out_tokens": tokens}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8, help="distillation epochs of every run")
    parser.add_argument("--top-ks", type=int, nargs="+", default=[1, 8, 32], help="K of the top-K runs")
    parser.add_argument("--beta", type=float, default=0.0)
    parser.add_argument("--teacher-steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work-dir", type=Path, default=None, help="keep models and runs here")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = parser.parse_args(argv)

    import tempfile

    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(HERE))
    from bench_cache_train import build_task

    from fastdistill.train import AsyncDistillationConfig, AsyncDistillationTrainer

    work = args.work_dir or Path(tempfile.mkdtemp(prefix="bench-hidden-"))
    started = time.perf_counter()
    task = build_task(work, args.teacher_steps, args.seed)
    s = task["settings"]
    teacher = AutoModelForCausalLM.from_pretrained(task["teacher_dir"], dtype=torch.float32).eval()
    eos = int(teacher.config.eos_token_id)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(task["teacher_dir"])
    train_prompts = [tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True,
                                                   return_dict=False) for row in task["train_rows"]]
    held_prompts = [row["prompt_ids"] for row in task["held_rows"]]
    held_completions = [greedy_answer(teacher, p, s.max_completion_length, eos) for p in held_prompts]
    train_completions = [greedy_answer(teacher, p, s.max_completion_length, eos) for p in train_prompts]
    runs: dict[str, dict[str, Any]] = {}
    baseline = full_vocab_divergence(task["student_dir"], teacher, held_prompts, held_completions, args.beta)
    signals = [("hidden", 0)] + [("topk", k) for k in args.top_ks]
    for signal, k in signals:
        name = "hidden" if signal == "hidden" else f"topk-{k}"
        once = make_samples(teacher, train_prompts, train_completions, signal, top_k=max(k, 1))
        # given samples are trained once each: repeat them for the epochs (a fresh prompt id per repeat)
        repeats = max(1, round(args.epochs))
        samples = [dataclasses.replace(s, prompt_id=e * len(once) + s.prompt_id) for e in range(repeats) for s in once]
        output = work / name
        config = AsyncDistillationConfig(
            model_name_or_path=str(task["student_dir"]), output_dir=str(output), learning_rate=s.learning_rate,
            lr_scheduler_type="cosine", warmup_ratio=s.warmup_ratio, num_train_epochs=1,
            per_device_train_batch_size=s.batch_size, token_budget=0, beta=args.beta, teacher_top_k=max(k, 1),
            gradient_checkpointing=False, save_strategy="no", export_final_model=True, disable_tqdm=True,
            weight_sync_backend="none", teacher_signal=signal,
            teacher_model_paths={"default": str(task["teacher_dir"])} if signal == "hidden" else None,
            seed=args.seed)
        summary = AsyncDistillationTrainer(config, samples=samples).train()
        measured = full_vocab_divergence(output / "final", teacher, held_prompts, held_completions, args.beta)
        runs[name] = {"signal": signal, "top_k": k or None, "steps": summary["steps"],
                      "trained_tokens": summary["trained_tokens"],
                      "trained_tokens_per_s": summary["trained_tokens_per_s"],
                      "train_seconds": summary["train_seconds"], **measured}
    report = {"benchmark": "bench_hidden_teacher", "date": datetime.now(UTC).isoformat(timespec="seconds"),
              "machine": {"platform": platform.platform(), "threads": torch.get_num_threads(),
                          "device": "cpu"},
              "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "train_prompts": len(train_prompts), "held_out_prompts": len(held_prompts),
              "before_training": baseline, "runs": runs, "wall_seconds": time.perf_counter() - started}
    header = f"{'run':<10} {'steps':>5} {'tok/s':>8} {'held-out JSD(β)':>16} {'held-out KL(t‖s)':>17}"
    print(header)
    print(f"{'initial':<10} {'':>5} {'':>8} {baseline['held_out_jsd']:>16.4f} {baseline['held_out_forward_kl']:>17.4f}")
    for name, run in runs.items():
        print(f"{name:<10} {run['steps']:>5} {run['trained_tokens_per_s']:>8.1f} {run['held_out_jsd']:>16.4f} "
              f"{run['held_out_forward_kl']:>17.4f}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.json}")
    return report


if __name__ == "__main__":
    main()
