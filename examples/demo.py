"""End-to-end on-policy distillation of a tiny student from a tiny teacher, on CPU, in a couple of minutes.

What it does, all in one process and fully offline:

1. trains a byte-level BPE tokenizer and a TEACHER (a tiny Qwen3) on a toy chat task built in code
   (single-digit additions, counting, spelling short words backwards) with plain next-token cross-entropy;
2. builds a STUDENT with the same vocabulary from a different random initialisation;
3. distils on-policy: the student samples completions, the teacher scores them teacher-forced and reports
   per position its top-K log-probs plus the realised token's (TRL's (L, K+1) wire format), and the student
   minimises fastdistill's sparse generalized JSD over packed rows (position_ids restart per sample);
4. reports the JSD at the start and end, the student's teacher-forced KL to the teacher on held-out
   prompts and its accuracy, before and after, and writes ``<out>/summary.json``.

This demo is SYNCHRONOUS: generation, scoring and training take turns in one process. The asynchronous
pipeline (vLLM servers, rollout worker, queue, weight sync) comes later; this script shows the loss and the
data layout it trains on. It exits non-zero when distillation does not reduce the divergence.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import PreTrainedTokenizerFast, Qwen3ForCausalLM
from transformers.utils import logging as hf_logging

from fastdistill import narrow_support, sparse_jsd_loss
from fastdistill.tiny import build_model, build_tokenizer, tiny_config

TOP_K = 8
TEACHER_LR = 3e-3
STUDENT_LR = 3e-3
MAX_NEW_TOKENS = 16
WORDS = ["cat", "dog", "sun", "tree", "bird", "fish", "milk", "star", "moon", "lamp", "book", "rain", "frog",
         "ship", "wolf", "bear", "cake", "door", "leaf", "rose"]


@dataclass(frozen=True)
class Example:
    """One toy chat exchange: a user question and its deterministic answer."""

    question: str
    answer: str


@dataclass(frozen=True)
class Settings:
    """Sizes and step counts of one run."""

    teacher_steps: int
    teacher_batch: int
    distill_steps: int
    distill_batch: int
    held_out: int
    log_every: int


DEFAULT = Settings(teacher_steps=300, teacher_batch=32, distill_steps=600, distill_batch=16, held_out=24,
                   log_every=25)
QUICK = Settings(teacher_steps=120, teacher_batch=32, distill_steps=20, distill_batch=8, held_out=8, log_every=5)


# ---------------------------------------------------------------------------------------------------------------
# Toy task and tokenization


def toy_task() -> list[Example]:
    """Single-digit additions, counting to n and spelling short words backwards."""
    additions = [Example(f"What is {a} + {b}?", str(a + b)) for a in range(10) for b in range(10)]
    counts = [Example(f"Count to {n}.", " ".join(str(i) for i in range(1, n + 1))) for n in range(1, 10)]
    reversals = [Example(f"Spell '{word}' backwards.", word[::-1]) for word in WORDS]
    return additions + counts + reversals


def tokenizer_corpus(examples: list[Example]) -> list[str]:
    """The texts the tokenizer is trained on: every question, every answer and the chat roles."""
    return ["user", "assistant"] + [text for ex in examples for text in (ex.question, ex.answer)]


def prompt_ids(tokenizer: PreTrainedTokenizerFast, example: Example) -> list[int]:
    """The chat-templated user turn followed by the assistant header."""
    messages = [{"role": "user", "content": example.question}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)


def answer_ids(tokenizer: PreTrainedTokenizerFast, example: Example) -> list[int]:
    """The reference completion: the answer's tokens and the end-of-turn token."""
    return tokenizer(example.answer)["input_ids"] + [tokenizer.eos_token_id]


# ---------------------------------------------------------------------------------------------------------------
# Packed rows


@dataclass
class PackedRow:
    """Samples (prompt + completion) concatenated into one row; position_ids restart at 0 for each sample."""

    input_ids: torch.Tensor  # (1, T)
    position_ids: torch.Tensor  # (1, T)
    completion_mask: torch.Tensor  # (T,) bool: token t belongs to a completion


def pack(prompts: list[list[int]], completions: list[list[int]]) -> PackedRow:
    """Pack ``prompt + completion`` samples into one padding-free row."""
    ids, positions, is_completion = [], [], []
    for prompt, completion in zip(prompts, completions, strict=True):
        ids += prompt + completion
        positions += range(len(prompt) + len(completion))
        is_completion += [False] * len(prompt) + [True] * len(completion)
    return PackedRow(
        input_ids=torch.tensor([ids]),
        position_ids=torch.tensor([positions]),
        completion_mask=torch.tensor(is_completion),
    )


def packed_logits(model: Qwen3ForCausalLM, row: PackedRow) -> torch.Tensor:
    """(T, V) logits of a packed row: no attention mask and no cache, so samples never attend to each other."""
    return model(row.input_ids, position_ids=row.position_ids, use_cache=False).logits[0]


# ---------------------------------------------------------------------------------------------------------------
# Teacher training


def train_teacher(model: Qwen3ForCausalLM, tokenizer, examples: list[Example], settings: Settings,
                  rng: random.Random) -> list[float]:
    """Supervised next-token cross-entropy on the answers (prompt tokens are not trained). Returns the losses."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=TEACHER_LR, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=TEACHER_LR, total_steps=settings.teacher_steps,
                                                   pct_start=0.1)
    losses = []
    for _ in range(settings.teacher_steps):
        batch = rng.sample(examples, settings.teacher_batch)
        row = pack([prompt_ids(tokenizer, ex) for ex in batch], [answer_ids(tokenizer, ex) for ex in batch])
        labels = torch.where(row.completion_mask, row.input_ids[0], -100).unsqueeze(0)
        loss = model(row.input_ids, position_ids=row.position_ids, labels=labels, use_cache=False).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
    return losses


# ---------------------------------------------------------------------------------------------------------------
# Rollout: student generation and teacher scoring


@torch.no_grad()
def generate(model: Qwen3ForCausalLM, tokenizer, prompts: list[list[int]], sample: bool) -> list[list[int]]:
    """Completion ids for each prompt (sampled at temperature 1 over the full vocabulary, or greedy).

    A completion ends with the end-of-turn token when the model emitted it within ``MAX_NEW_TOKENS``.
    """
    batch = tokenizer.pad({"input_ids": prompts}, padding_side="left", return_tensors="pt")
    sampling = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0} if sample else {"do_sample": False}
    output = model.generate(**batch, max_new_tokens=MAX_NEW_TOKENS, use_cache=True,
                            pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, **sampling)
    completions = []
    for tokens in output[:, batch["input_ids"].shape[1]:].tolist():
        if tokenizer.eos_token_id in tokens:
            tokens = tokens[: tokens.index(tokenizer.eos_token_id) + 1]
        completions.append(tokens)
    return completions


@torch.no_grad()
def score_with_teacher(teacher: Qwen3ForCausalLM, row: PackedRow, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's sparse view of a packed row, in TRL's wire format.

    Returns ``(candidate_ids, candidate_logprobs)``, each ``(T, K+1)``: row t holds the candidates for predicting
    token t, i.e. the teacher's top-K (rank-sorted) plus, in the last slot, the realised token when it is outside
    the top-K. Rows of prompt tokens are empty (-1 ids, -inf log-probs), as in ``prompt_logprobs``.
    """
    logprobs = torch.log_softmax(packed_logits(teacher, row).float(), dim=-1)[:-1]  # row t-1 predicts token t
    targets = row.input_ids[0, 1:]
    top_logprobs, top_ids = logprobs.topk(top_k, dim=-1)
    in_top_k = (top_ids == targets[:, None]).any(dim=-1)
    extra_ids = torch.where(in_top_k, -1, targets)
    extra_logprobs = torch.where(in_top_k, float("-inf"), logprobs.gather(1, targets[:, None]).squeeze(1))

    candidate_ids = torch.full((targets.numel() + 1, top_k + 1), -1, dtype=torch.long)
    candidate_logprobs = torch.full(candidate_ids.shape, float("-inf"))
    candidate_ids[1:] = torch.cat([top_ids, extra_ids[:, None]], dim=1)
    candidate_logprobs[1:] = torch.cat([top_logprobs, extra_logprobs[:, None]], dim=1)
    candidate_ids[~row.completion_mask] = -1
    candidate_logprobs[~row.completion_mask] = float("-inf")
    return candidate_ids, candidate_logprobs


# ---------------------------------------------------------------------------------------------------------------
# Distillation


def distillation_step(student: Qwen3ForCausalLM, row: PackedRow, candidate_ids: torch.Tensor,
                      candidate_logprobs: torch.Tensor, beta: float, optimizer) -> dict[str, float]:
    """One optimizer step of the sparse generalized JSD on a packed row; returns per-token metrics."""
    hidden = student.model(row.input_ids, position_ids=row.position_ids, use_cache=False).last_hidden_state[0]
    trained = row.completion_mask[1:]  # hidden position j predicts token j+1
    ids, lps, mask = narrow_support(candidate_ids[1:][trained], candidate_logprobs[1:][trained],
                                    row.input_ids[0, 1:][trained], beta)
    out = sparse_jsd_loss(hidden[:-1][trained], student.lm_head.weight, ids, lps, mask, beta=beta)
    num_tokens = max(int(out.num_tokens), 1)
    optimizer.zero_grad()
    (out.loss / num_tokens).backward()
    optimizer.step()
    return {
        "jsd": out.jsd_sum.item() / num_tokens,
        "entropy": out.entropy_sum.item() / num_tokens,
        "teacher_entropy": out.teacher_entropy_sum.item() / num_tokens,
        "num_tokens": int(out.num_tokens),
    }


def distill(student, teacher, tokenizer, examples: list[Example], settings: Settings, beta: float,
            rng: random.Random) -> list[dict]:
    """The on-policy loop: student samples, teacher scores, student steps. Returns the per-step metrics."""
    optimizer = torch.optim.AdamW(student.parameters(), lr=STUDENT_LR, weight_decay=0.0)
    history = []
    for step in range(1, settings.distill_steps + 1):
        prompts = [prompt_ids(tokenizer, ex) for ex in rng.sample(examples, settings.distill_batch)]
        completions = generate(student, tokenizer, prompts, sample=True)
        row = pack(prompts, completions)
        candidate_ids, candidate_logprobs = score_with_teacher(teacher, row, TOP_K)
        metrics = distillation_step(student, row, candidate_ids, candidate_logprobs, beta, optimizer)
        metrics["step"] = step
        metrics["completion_len"] = sum(map(len, completions)) / len(completions)
        history.append(metrics)
        if step % settings.log_every == 0 or step == 1:
            print(f"  step {step:3d}  jsd/token {metrics['jsd']:.4f}  entropy/token {metrics['entropy']:.3f}  "
                  f"teacher entropy/token {metrics['teacher_entropy']:.3f}  "
                  f"completion len {metrics['completion_len']:.1f}", flush=True)
    return history


# ---------------------------------------------------------------------------------------------------------------
# Evaluation


@dataclass
class EvalSet:
    """Prompts to evaluate on, with the teacher's greedy answers packed for teacher-forced scoring."""

    name: str
    examples: list[Example]
    teacher_answers: PackedRow


def make_eval_set(name: str, teacher, tokenizer, examples: list[Example]) -> EvalSet:
    """Generate the teacher's greedy answers to ``examples`` once, for every later evaluation."""
    prompts = [prompt_ids(tokenizer, ex) for ex in examples]
    return EvalSet(name, examples, pack(prompts, generate(teacher, tokenizer, prompts, sample=False)))


def decode_answer(tokenizer, completion: list[int]) -> str:
    """The answer text of a completion, without the end-of-turn token."""
    return tokenizer.decode(completion, skip_special_tokens=True).strip()


def accuracy(model, tokenizer, examples: list[Example]) -> float:
    """Fraction of examples whose greedy completion is exactly the reference answer."""
    completions = generate(model, tokenizer, [prompt_ids(tokenizer, ex) for ex in examples], sample=False)
    answers = [decode_answer(tokenizer, completion) for completion in completions]
    return sum(answer == ex.answer for answer, ex in zip(answers, examples, strict=True)) / len(examples)


@torch.no_grad()
def forward_kl(student, teacher, row: PackedRow) -> float:
    """Mean over completion tokens of the full-vocabulary KL(teacher ‖ student), teacher-forced on ``row``."""
    scored = row.completion_mask[1:]  # position j predicts token j+1
    student_logprobs = torch.log_softmax(packed_logits(student, row)[:-1][scored].float(), dim=-1)
    teacher_logprobs = torch.log_softmax(packed_logits(teacher, row)[:-1][scored].float(), dim=-1)
    kl = F.kl_div(student_logprobs, teacher_logprobs, log_target=True, reduction="sum")
    return kl.item() / int(scored.sum())


def evaluate(student, teacher, tokenizer, eval_sets: list[EvalSet]) -> dict[str, dict[str, float]]:
    """Per set: KL(teacher ‖ student) per token on the teacher's answers, and the student's task accuracy."""
    return {
        s.name: {"forward_kl": forward_kl(student, teacher, s.teacher_answers),
                 "accuracy": accuracy(student, tokenizer, s.examples)}
        for s in eval_sets
    }


def sample_generations(student, teacher, tokenizer, examples: list[Example]) -> list[dict[str, str]]:
    """Greedy answers of teacher and student on a few prompts, next to the reference."""
    prompts = [prompt_ids(tokenizer, ex) for ex in examples]
    teacher_out = generate(teacher, tokenizer, prompts, sample=False)
    student_out = generate(student, tokenizer, prompts, sample=False)
    return [
        {"question": ex.question, "reference": ex.answer, "teacher": decode_answer(tokenizer, t),
         "student": decode_answer(tokenizer, s)}
        for ex, t, s in zip(examples, teacher_out, student_out, strict=True)
    ]


def print_evaluation(label: str, results: dict[str, dict[str, float]]) -> None:
    for name, r in results.items():
        print(f"  {label} on {name}: KL(teacher‖student) {r['forward_kl']:.3f}/token, accuracy {r['accuracy']:.0%}")


# ---------------------------------------------------------------------------------------------------------------
# Main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None,
                        help=f"distillation steps (default {DEFAULT.distill_steps}, --quick {QUICK.distill_steps})")
    parser.add_argument("--beta", type=float, default=0.0,
                        help="generalized JSD β: 0 forward KL over the top-K, 1 reverse KL over the sampled token only")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("demo_output"), help="where summary.json is written")
    parser.add_argument("--quick", action="store_true", help="a very small run (for tests)")
    parser.add_argument("--threads", type=int, default=2,
                        help="torch CPU threads; 1 is far faster when other jobs keep the cores busy")
    args = parser.parse_args(argv)
    if args.steps is not None and args.steps < 2:
        parser.error("--steps must be at least 2 to compare the divergence at the start and at the end")
    if not 0.0 <= args.beta <= 1.0:
        parser.error("--beta must be in [0, 1]")
    if args.threads < 1:
        parser.error("--threads must be at least 1")
    return args


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    settings = QUICK if args.quick else DEFAULT
    if args.steps is not None:
        settings = replace(settings, distill_steps=args.steps)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    hf_logging.disable_progress_bar()
    rng = random.Random(args.seed)
    started = time.perf_counter()
    print("fastdistill demo: synchronous, in-process on-policy distillation of tiny models "
          "(the asynchronous vLLM pipeline comes later)")

    examples = toy_task()
    tokenizer = build_tokenizer(tokenizer_corpus(examples))
    shuffled = rng.sample(examples, len(examples))
    held_out, distill_prompts = shuffled[: settings.held_out], shuffled[settings.held_out:]
    print(f"task: {len(examples)} examples, {len(distill_prompts)} distillation prompts and {len(held_out)} held out; "
          f"vocabulary {len(tokenizer)}")

    token_ids = {"pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id}
    teacher = build_model(tiny_config(len(tokenizer), hidden_size=128, intermediate_size=256, **token_ids),
                          seed=args.seed)
    student = build_model(tiny_config(len(tokenizer), **token_ids), seed=args.seed + 1)
    print(f"teacher: {teacher.num_parameters():,} parameters; student: {student.num_parameters():,} parameters")
    print(f"training the teacher: {settings.teacher_steps} steps of cross-entropy on every example")
    teacher_started = time.perf_counter()
    teacher_losses = train_teacher(teacher, tokenizer, examples, settings, rng)
    teacher_seconds = time.perf_counter() - teacher_started
    teacher.eval().requires_grad_(False)
    teacher_accuracy = {"held_out": accuracy(teacher, tokenizer, held_out),
                        "distillation_prompts": accuracy(teacher, tokenizer, distill_prompts)}
    print(f"  teacher loss {mean(teacher_losses[:10]):.3f} -> {mean(teacher_losses[-10:]):.3f}; accuracy "
          f"{teacher_accuracy['distillation_prompts']:.0%} on the distillation prompts, "
          f"{teacher_accuracy['held_out']:.0%} on the held-out ones (it was trained on both)")

    eval_sets = [make_eval_set("distillation_prompts", teacher, tokenizer, distill_prompts),
                 make_eval_set("held_out", teacher, tokenizer, held_out)]
    before = evaluate(student, teacher, tokenizer, eval_sets)
    print_evaluation("student before", before)

    print(f"distilling on-policy: {settings.distill_steps} steps, β={args.beta}, top-K {TOP_K}, "
          f"{settings.distill_batch} prompts a step")
    distill_started = time.perf_counter()
    history = distill(student, teacher, tokenizer, distill_prompts, settings, args.beta, rng)
    distill_seconds = time.perf_counter() - distill_started
    after = evaluate(student, teacher, tokenizer, eval_sets)
    window = max(1, min(10, settings.distill_steps // 4))
    jsd_start, jsd_end = mean([h["jsd"] for h in history[:window]]), mean([h["jsd"] for h in history[-window:]])
    samples = sample_generations(student, teacher, tokenizer, held_out[:4])
    runtime = time.perf_counter() - started

    print(f"JSD/token on the student's samples (mean of the first/last {window} steps): "
          f"{jsd_start:.4f} -> {jsd_end:.4f}")
    print_evaluation("student before", before)
    print_evaluation("student after ", after)
    print("held-out samples (greedy):")
    for sample in samples:
        print(f"  {sample['question']!r}: reference {sample['reference']!r}, teacher {sample['teacher']!r}, "
              f"student {sample['student']!r}")
    print(f"runtime {runtime:.1f} s (teacher training {teacher_seconds:.1f} s, distillation {distill_seconds:.1f} s)")

    args.out.mkdir(parents=True, exist_ok=True)
    summary = {
        "mode": "synchronous, in-process (the asynchronous vLLM pipeline comes later)",
        "args": {"steps": settings.distill_steps, "beta": args.beta, "seed": args.seed, "quick": args.quick,
                 "threads": args.threads},
        "settings": asdict(settings),
        "top_k": TOP_K,
        "teacher": {"loss_start": mean(teacher_losses[:10]), "loss_end": mean(teacher_losses[-10:]),
                    "accuracy": teacher_accuracy},
        "history": history,
        "jsd_start": jsd_start,
        "jsd_end": jsd_end,
        "before": before,
        "after": after,
        "samples": samples,
        "runtime_s": runtime,
        "teacher_training_s": teacher_seconds,
        "distillation_s": distill_seconds,
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"wrote {args.out / 'summary.json'}")

    kl_before, kl_after = before["held_out"]["forward_kl"], after["held_out"]["forward_kl"]
    if not (jsd_end < jsd_start and kl_after < kl_before):
        print(f"FAILED: distillation did not reduce the divergence to the teacher (JSD/token {jsd_start:.4f} -> "
              f"{jsd_end:.4f}, held-out KL/token {kl_before:.3f} -> {kl_after:.3f})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
