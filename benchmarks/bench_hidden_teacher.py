"""Top-K against hidden-state teacher signal: the held-out full-vocabulary divergence after the same training steps,
and trained tokens per second.

One process, no servers (the teacher signal is computed with Hugging Face transformers, exactly what the two server
routes return: ``prompt_logprobs`` top-K, or the final hidden states that ``serve-teacher --signal hidden`` sends).
Two tasks (``--task``):

- ``zipf`` (default): a synthetic language built in code whose completions have real entropy over many tokens, the
  case where a top-K list and a tail bucket are a biased view of the teacher. A prompt is ``<|im_start|>``, a topic
  token and 2–5 filler words; its completion has 16–48 words (length uniform) then eos. Each topic owns 64 of the
  256 words and a Zipf exponent in [0.7, 1.3]; the next word is drawn from the topic's words with probability
  ∝ 1/rank^exponent, the ranking rotated by a quarter of the list for each class (index mod 4) of the previous word.
  That is about 3.3 nats (tens of plausible words) per position. A tiny Qwen3 teacher (hidden 128) is trained by
  cross-entropy on fresh samples of the language (``--teacher-steps`` × 32 sequences) until it models that spread;
  the student is a fresh smaller one (hidden 64). Completions are sampled from the teacher at temperature 1.
- ``demo``: the demo's toy task (``bench_cache_train.build_task``: additions, counting, reversed words) with the
  teacher's greedy answers (about 2 tokens, nearly deterministic).

Then:

1. every training prompt gets one teacher completion, fixed for all signals of a run seed, so the runs differ only in
   the teacher signal (held-out prompts, new ones, get theirs once for all run seeds);
2. the student is distilled for each ``--epochs`` value from those samples through the trainer (given samples), once
   per signal: hidden (``dense_teacher_jsd_loss`` with the teacher's head, bfloat16 rows as on the wire) and top-K
   at each K of ``--top-ks`` (``sparse_jsd_loss``: the K candidates, the realised token and a tail bucket); same
   learning rate, schedule, batch, β and steps; trained tokens/s from each run's train_summary.json, and at its
   median step time (metrics.jsonl ``perf/step_s``: a busy spell of a shared machine moves the mean, not the
   median);
3. every trained student is measured on the held-out completions: the full-vocabulary generalized JSD at β and the
   forward KL(teacher‖student), float64, nats per completion token; with the teacher's mean entropy there, the
   teacher mass its top K tokens hold, and (zipf) the language's own entropy and KL(language‖teacher).

Each ``--run-seeds`` entry repeats step 1–3 with its own student initialisation (seed + 1), sampled training
completions and trainer seed; the teacher and the held-out set stay fixed, so the spread across run seeds is the
run-to-run spread of the comparison. The hidden route's cost on the wire and on the server is measured in
docs/hidden-teacher.md; here only the trainer's side counts.

    python benchmarks/bench_hidden_teacher.py --run-seeds 0 1 2 --json /tmp/bench_hidden.json   # about 6 min, 2 CPUs
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import platform
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
# fastdistill_testing (the test harness: at the repository root, not installed with the wheel)
sys.path.insert(0, str(HERE.parent))
DEFAULT_JSON = HERE / "results" / "bench_hidden_teacher.json"
TASKS = ("zipf", "demo")


class ZipfLanguage:
    """A prompt-dependent synthetic language with a known next-token distribution.

    Token ids: 0 pad, 1 ``<|im_start|>``, 2 eos (the tiny tokenizer's specials), then ``topics`` topic tokens, then
    ``words`` word tokens. A prompt is ``[1, topic, 2–5 random words]``. After ``j`` completion words the next token is
    eos with the hazard of a length uniform on [``min_length``, ``max_length``], otherwise a word of the topic's
    ``support`` words with probability ∝ 1/rank^s (s: the topic's exponent), the ranking rotated by
    ``support / classes`` places for each class (word index mod ``classes``) of the previous token.
    """

    def __init__(self, *, topics: int = 16, words: int = 256, support: int = 64, classes: int = 4,
                 min_length: int = 16, max_length: int = 48, exponents: tuple[float, float] = (0.7, 1.3),
                 seed: int = 0):
        rng = np.random.default_rng(seed)
        self.topics, self.words, self.classes = topics, words, classes
        self.min_length, self.max_length = min_length, max_length
        self.eos, self.first_topic, self.first_word = 2, 3, 3 + topics
        self.vocab_size = self.first_word + words
        self.exponents = np.linspace(*exponents, topics)[rng.permutation(topics)]
        supports = np.stack([rng.choice(words, support, replace=False) for _ in range(topics)]) + self.first_word
        # table[topic, class]: the word distribution after a word of that class, (topics, classes, vocab_size)
        self.table = np.zeros((topics, classes, self.vocab_size))
        for topic in range(topics):
            for cls in range(classes):
                ranks = (np.arange(support) + cls * support // classes) % support
                weights = (ranks + 1.0) ** -self.exponents[topic]
                self.table[topic, cls, supports[topic]] = weights / weights.sum()

    def token_names(self) -> list[str]:
        """The names of the non-special tokens, in id order from 3 (``T0``… topics, ``w0``… words)."""
        return [f"T{i}" for i in range(self.topics)] + [f"w{i}" for i in range(self.words)]

    def next_token_probs(self, prompt: list[int], prefix: list[int]) -> np.ndarray:
        """float64 (vocab_size,): the distribution of the token after ``prompt + prefix`` (``prefix``: the
        completion so far, without eos)."""
        topic = prompt[1] - self.first_topic
        cls = ((prefix or prompt)[-1] - self.first_word) % self.classes
        j = len(prefix)
        stop = 0.0 if j < self.min_length else 1.0 / (self.max_length - j + 1)
        probs = self.table[topic, cls] * (1.0 - stop)
        probs[self.eos] = stop
        return probs

    def sample_prompt(self, rng: np.random.Generator) -> list[int]:
        """``[1, topic, 2–5 random words]``."""
        fillers = self.first_word + rng.integers(self.words, size=int(rng.integers(2, 6)))
        return [1, self.first_topic + int(rng.integers(self.topics))] + fillers.tolist()

    def sample_completion(self, prompt: list[int], rng: np.random.Generator) -> list[int]:
        """One completion drawn from the language, ending with eos."""
        out: list[int] = []
        while True:
            token = int(rng.choice(self.vocab_size, p=self.next_token_probs(prompt, out)))
            out.append(token)
            if token == self.eos:
                return out

    def unique_prompts(self, count: int, rng: np.random.Generator) -> list[list[int]]:
        """``count`` distinct prompts."""
        seen: set[tuple[int, ...]] = set()
        prompts = []
        while len(prompts) < count:
            prompt = self.sample_prompt(rng)
            if tuple(prompt) not in seen:
                seen.add(tuple(prompt))
                prompts.append(prompt)
        return prompts


@dataclasses.dataclass(frozen=True)
class ZipfSettings:
    """Model sizes and optimiser settings of the zipf task (the step counts are command-line options)."""

    teacher_hidden_size: int = 128
    student_hidden_size: int = 64
    num_layers: int = 2
    teacher_batch: int = 32
    teacher_lr: float = 3e-3
    batch_size: int = 32
    learning_rate: float = 5e-3
    warmup_ratio: float = 0.05


@dataclasses.dataclass
class Task:
    """What the runs need from a task: the saved teacher, the fresh student's folder (config and tokenizer; the
    weights are re-initialised per run seed), prompts and the distillation settings."""

    name: str
    teacher_dir: Path
    student_dir: Path
    train_prompts: list[list[int]]
    held_prompts: list[list[int]]
    max_completion_length: int
    sampled: bool  # completions sampled at temperature 1 (else greedy)
    batch_size: int
    learning_rate: float
    warmup_ratio: float
    language: ZipfLanguage | None = None
    teacher_training: dict[str, Any] = dataclasses.field(default_factory=dict)


def word_tokenizer(names: list[str]) -> Any:
    """A word-level tokenizer: the tiny tokenizer's three specials (ids 0–2), then ``names`` (ids 3…)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from fastdistill.tiny import CHAT_TEMPLATE, EOS_TOKEN, PAD_TOKEN, SPECIAL_TOKENS

    vocab = {name: index for index, name in enumerate(SPECIAL_TOKENS + names)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token=PAD_TOKEN))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=PAD_TOKEN, eos_token=EOS_TOKEN,
                                   chat_template=CHAT_TEMPLATE)


def train_on_language(model: torch.nn.Module, language: ZipfLanguage, *, steps: int, batch: int, lr: float,
                      rng: np.random.Generator) -> list[float]:
    """Cross-entropy on the completions (eos included) of fresh samples of ``language``, ``batch`` sequences packed
    in one row per step (:func:`fastdistill.demo.train_packed`). Returns the per-step losses (nats per completion
    token)."""
    from fastdistill.demo import train_packed

    def next_batch() -> list[tuple[list[int], list[int]]]:
        out = []
        for _ in range(batch):
            prompt = language.sample_prompt(rng)
            out.append((prompt, language.sample_completion(prompt, rng)))
        return out

    return train_packed(model, next_batch, steps=steps, lr=lr)


def build_zipf_task(work: Path, teacher_steps: int, seed: int, train_prompts: int, held_out: int) -> Task:
    """The zipf language, its teacher trained ``teacher_steps`` steps and a fresh student saved under ``work``, and
    ``train_prompts`` training and ``held_out`` new held-out prompts."""
    from fastdistill.tiny import build_model, save_pretrained_dir, tiny_config

    s = ZipfSettings()
    language = ZipfLanguage(seed=seed)
    tokenizer = word_tokenizer(language.token_names())
    assert len(tokenizer) == language.vocab_size
    special = {"pad_token_id": 0, "eos_token_id": language.eos, "num_layers": s.num_layers}
    teacher = build_model(tiny_config(language.vocab_size, hidden_size=s.teacher_hidden_size,
                                      intermediate_size=2 * s.teacher_hidden_size, **special), seed=seed)
    student = build_model(tiny_config(language.vocab_size, hidden_size=s.student_hidden_size,
                                      intermediate_size=2 * s.student_hidden_size, **special), seed=seed + 1)
    rng = np.random.default_rng(seed)
    started = time.perf_counter()
    losses = train_on_language(teacher, language, steps=teacher_steps, batch=s.teacher_batch, lr=s.teacher_lr,
                               rng=rng)
    training = {"steps": teacher_steps, "batch": s.teacher_batch, "lr": s.teacher_lr,
                "seconds": time.perf_counter() - started,
                "final_loss_mean_last_10": float(np.mean(losses[-10:])) if losses else None}
    prompts = language.unique_prompts(train_prompts + held_out, rng)
    return Task(name="zipf", teacher_dir=save_pretrained_dir(teacher.eval(), tokenizer, work / "teacher"),
                student_dir=save_pretrained_dir(student, tokenizer, work / "student"),
                train_prompts=prompts[:train_prompts], held_prompts=prompts[train_prompts:],
                max_completion_length=language.max_length + 1, sampled=True, batch_size=s.batch_size,
                learning_rate=s.learning_rate, warmup_ratio=s.warmup_ratio, language=language,
                teacher_training=training | {"settings": dataclasses.asdict(s)})


def build_demo_task(work: Path, teacher_steps: int, seed: int) -> Task:
    """The demo's toy task (``bench_cache_train.build_task``) with chat-templated prompts and greedy answers."""
    from transformers import AutoTokenizer

    sys.path.insert(0, str(HERE))
    from bench_cache_train import build_task

    started = time.perf_counter()
    task = build_task(work, teacher_steps, seed)
    s = task["settings"]
    tokenizer = AutoTokenizer.from_pretrained(task["teacher_dir"])
    train_prompts = [tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True,
                                                   return_dict=False) for row in task["train_rows"]]
    return Task(name="demo", teacher_dir=task["teacher_dir"], student_dir=task["student_dir"],
                train_prompts=train_prompts, held_prompts=[row["prompt_ids"] for row in task["held_rows"]],
                max_completion_length=s.max_completion_length, sampled=False, batch_size=s.batch_size,
                learning_rate=s.learning_rate, warmup_ratio=s.warmup_ratio,
                teacher_training={"steps": teacher_steps, "seconds": time.perf_counter() - started})


@torch.no_grad()
def teacher_completions(teacher: torch.nn.Module, prompts: list[list[int]], max_tokens: int, eos: int, *,
                        sampled: bool, seed: int = 0) -> list[list[int]]:
    """The teacher's completion of every prompt (at most ``max_tokens`` tokens, eos included when reached): drawn
    at temperature 1 from the full distribution (``sampled``, a ``torch.Generator`` seeded with ``seed``), or
    greedy. Prompts of one length decode together in one batch with a KV cache."""
    generator = torch.Generator().manual_seed(seed)
    out: list[list[int] | None] = [None] * len(prompts)
    by_length: dict[int, list[int]] = {}
    for index, prompt in enumerate(prompts):
        by_length.setdefault(len(prompt), []).append(index)
    for length in sorted(by_length):
        rows = by_length[length]
        ids = torch.tensor([prompts[i] for i in rows])
        past = None
        tokens = []
        done = torch.zeros(len(rows), dtype=torch.bool)
        for _ in range(max_tokens):
            result = teacher(ids, cache=past, use_cache=True)
            past = result.cache
            logits = result.logits[:, -1].double()
            if sampled:
                step = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)[:, 0]
            else:
                step = logits.argmax(dim=-1)
            tokens.append(step)
            done |= step == eos
            if bool(done.all()):
                break
            ids = step[:, None]
        drawn = torch.stack(tokens, dim=1).tolist()
        for row, index in enumerate(rows):
            completion = drawn[row]
            out[index] = completion[: completion.index(eos) + 1] if eos in completion else completion
    return out  # type: ignore[return-value]


def make_samples(teacher: torch.nn.Module, prompts: list[list[int]], completions: list[list[int]], signal: str,
                 top_k: int = 8) -> list[Any]:
    """One :class:`RolloutSample` per prompt and its completion, scored top-K or as (bfloat16) hidden rows."""
    from fastdistill.rollout.client import Generation
    from fastdistill.rollout.decode import TeacherScores
    from fastdistill.rollout.hidden import TeacherHiddenStates
    from fastdistill.rollout.sample import RolloutSample
    from fastdistill_testing.synthetic import score_completion

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


@torch.no_grad()
def teacher_spread(teacher: torch.nn.Module, prompts: list[list[int]], completions: list[list[int]],
                   top_ks: list[int], language: ZipfLanguage | None = None) -> dict[str, Any]:
    """How spread the teacher is on the held-out completions, float64, per completion token: its mean entropy
    (nats), the mean probability mass of its K most likely tokens for each K, and with ``language`` the language's
    own entropy and KL(language‖teacher) at the same positions."""
    reference = copy.deepcopy(teacher).double().eval()
    entropy, true_entropy, true_kl, tokens = 0.0, 0.0, 0.0, 0
    mass = dict.fromkeys(top_ks, 0.0)
    for prompt, completion in zip(prompts, completions, strict=True):
        if not completion:
            continue
        logits = reference(torch.tensor([prompt + completion])).logits[0]
        logprobs = torch.log_softmax(logits[len(prompt) - 1 : len(prompt) + len(completion) - 1], dim=-1)
        probs = logprobs.exp()
        entropy += float(-(probs * logprobs).sum())
        for k in top_ks:
            mass[k] += float(probs.topk(min(k, probs.shape[-1]), dim=-1).values.sum())
        if language is not None:
            for j in range(len(completion)):
                true = torch.from_numpy(language.next_token_probs(prompt, completion[:j]))
                support = true > 0
                true_entropy -= float((true[support] * true[support].log()).sum())
                true_kl += float((true[support] * (true[support].log() - logprobs[j, support])).sum())
        tokens += len(completion)
    tokens = max(tokens, 1)
    out: dict[str, Any] = {"teacher_entropy": entropy / tokens,
                           "teacher_top_k_mass": {str(k): v / tokens for k, v in mass.items()}}
    if language is not None:
        out |= {"language_entropy": true_entropy / tokens, "kl_language_teacher": true_kl / tokens}
    return out


def fresh_student(student_dir: Path, seed: int, output: Path) -> Path:
    """A student with ``student_dir``'s configuration and tokenizer, initialised with ``seed``, saved at ``output``."""
    from transformers import AutoConfig, AutoTokenizer

    from fastdistill.tiny import build_model, save_pretrained_dir

    model = build_model(AutoConfig.from_pretrained(student_dir), seed=seed)
    return save_pretrained_dir(model, AutoTokenizer.from_pretrained(student_dir), output)


def spread(values: list[float]) -> dict[str, float]:
    """Mean, min and max of a run's values across run seeds."""
    return {"mean": float(np.mean(values)), "min": float(np.min(values)), "max": float(np.max(values))}


def distill_run(task: Task, student_dir: Path, once: list[Any], signal: str, top_k: int, epochs: int, beta: float,
                run_seed: int, work: Path) -> dict[str, Any]:
    """Distil the student at ``student_dir`` from the samples ``once`` repeated ``epochs`` times, through the trainer
    with given samples; returns the run's train_summary.json figures, and tokens/s at the median step time."""
    from fastdistill.train import AsyncDistillationConfig, AsyncDistillationTrainer

    name = "hidden" if signal == "hidden" else f"topk-{top_k}"
    # given samples are trained once each: repeat them for the epochs (a fresh prompt id per repeat)
    samples = [dataclasses.replace(s, prompt_id=e * len(once) + s.prompt_id) for e in range(epochs) for s in once]
    output = f"{name}-{epochs}ep-seed{run_seed}"
    config = AsyncDistillationConfig(
        model_name_or_path=str(student_dir), output_dir=str(work / output), learning_rate=task.learning_rate,
        lr_scheduler_type="cosine", warmup_ratio=task.warmup_ratio, num_train_epochs=1,
        per_device_train_batch_size=task.batch_size, token_budget=0, beta=beta, teacher_top_k=max(top_k, 1),
        gradient_checkpointing=False, save_strategy="no", export_final_model=True, disable_tqdm=True,
        weight_sync_backend="none", teacher_signal=signal,
        teacher_model_paths={"default": str(task.teacher_dir)} if signal == "hidden" else None, seed=run_seed)
    AsyncDistillationTrainer(config, samples=samples).train()
    summary = json.loads((work / output / "train_summary.json").read_text())
    steps = [json.loads(line) for line in (work / output / "metrics.jsonl").read_text().splitlines() if line]
    median_step = float(np.median([row["perf/step_s"] for row in steps]))
    return {"name": name, "signal": signal, "top_k": top_k or None, "epochs": epochs, "run_seed": run_seed,
            "output": output, "steps": summary["steps"], "trained_tokens": summary["trained_tokens"],
            "trained_tokens_per_s": summary["trained_tokens_per_s"], "train_seconds": summary["train_seconds"],
            "median_step_s": median_step,
            "trained_tokens_per_s_median_step": summary["trained_tokens"] / (summary["steps"] * median_step)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=TASKS, default="zipf")
    parser.add_argument("--epochs", type=int, nargs="+", default=None,
                        help="distillation epochs; every signal runs once per value (zipf: 4 16, demo: 8)")
    parser.add_argument("--top-ks", type=int, nargs="+", default=[1, 8, 32], help="K of the top-K runs")
    parser.add_argument("--beta", type=float, default=0.0)
    parser.add_argument("--teacher-steps", type=int, default=None, help="teacher training steps (zipf 400, demo 300)")
    parser.add_argument("--train-prompts", type=int, default=512, help="zipf: training prompts")
    parser.add_argument("--held-out", type=int, default=64, help="zipf: held-out prompts")
    parser.add_argument("--seed", type=int, default=0, help="the task's seed (language, teacher, prompts)")
    parser.add_argument("--run-seeds", type=int, nargs="+", default=[0],
                        help="one set of runs per seed: student init (seed + 1), sampled completions, trainer seed")
    parser.add_argument("--work-dir", type=Path, default=None, help="keep models and runs here")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = parser.parse_args(argv)
    if min(args.top_ks) < 1:
        parser.error(f"--top-ks must be ≥ 1, got {args.top_ks}")
    if args.epochs is None:
        args.epochs = {"zipf": [4, 16], "demo": [8]}[args.task]
    if min(args.epochs) < 1:
        parser.error(f"--epochs must be ≥ 1, got {args.epochs}")
    if args.teacher_steps is None:
        args.teacher_steps = {"zipf": 400, "demo": 300}[args.task]

    from transformers import AutoModelForCausalLM

    work = args.work_dir or Path(tempfile.mkdtemp(prefix="bench-hidden-"))
    started = time.perf_counter()
    if args.task == "zipf":
        task = build_zipf_task(work, args.teacher_steps, args.seed, args.train_prompts, args.held_out)
    else:
        task = build_demo_task(work, args.teacher_steps, args.seed)
    teacher = AutoModelForCausalLM.from_pretrained(task.teacher_dir, dtype=torch.float32).eval()
    eos = int(teacher.config.eos_token_id)
    held_completions = teacher_completions(teacher, task.held_prompts, task.max_completion_length, eos,
                                           sampled=task.sampled, seed=10_000 + args.seed)
    teacher_info = teacher_spread(teacher, task.held_prompts, held_completions, args.top_ks, task.language)
    setup_seconds = time.perf_counter() - started

    runs: list[dict[str, Any]] = []
    before: dict[str, Any] = {}
    train_tokens: dict[str, int] = {}
    signals = [("hidden", 0)] + [("topk", k) for k in args.top_ks]
    for index, run_seed in enumerate(args.run_seeds):
        student_dir = fresh_student(task.student_dir, run_seed + 1, work / f"student-{run_seed}")
        before[str(run_seed)] = full_vocab_divergence(student_dir, teacher, task.held_prompts, held_completions,
                                                      args.beta)
        train_completions = teacher_completions(teacher, task.train_prompts, task.max_completion_length, eos,
                                                sampled=task.sampled, seed=run_seed)
        train_tokens[str(run_seed)] = sum(len(c) for c in train_completions)
        # a different signal first for each run seed, so that a busy spell of the machine hits different runs
        shift = index % len(signals)
        for signal, k in signals[shift:] + signals[:shift]:
            once = make_samples(teacher, task.train_prompts, train_completions, signal, top_k=max(k, 1))
            for epochs in args.epochs:
                run = distill_run(task, student_dir, once, signal, k, epochs, args.beta, run_seed, work)
                run |= full_vocab_divergence(work / run["output"] / "final", teacher, task.held_prompts,
                                             held_completions, args.beta)
                runs.append(run)
                print(f"seed {run_seed} {run['name']}, {epochs} epochs: KL(t‖s) {run['held_out_forward_kl']:.4f}, "
                      f"{run['trained_tokens_per_s']:.0f} tokens/s", flush=True)

    summary: dict[str, Any] = {"before_training": {key: spread([b[key] for b in before.values()])
                                                   for key in ("held_out_forward_kl", "held_out_jsd")}}
    for epochs in args.epochs:
        for signal, k in signals:
            name = "hidden" if signal == "hidden" else f"topk-{k}"
            chosen = [r for r in runs if r["name"] == name and r["epochs"] == epochs]
            summary[f"{name}@{epochs}ep"] = {"steps": chosen[0]["steps"]} | {
                key: spread([r[key] for r in chosen])
                for key in ("held_out_forward_kl", "held_out_jsd", "trained_tokens_per_s",
                            "trained_tokens_per_s_median_step")}
    report = {"benchmark": "bench_hidden_teacher", "task": task.name,
              "date": datetime.now(UTC).isoformat(timespec="seconds"),
              "machine": {"platform": platform.platform(), "threads": torch.get_num_threads(), "device": "cpu"},
              "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "teacher_training": task.teacher_training, "train_prompts": len(task.train_prompts),
              "train_completion_tokens": train_tokens, "held_out_prompts": len(task.held_prompts),
              "held_out_tokens": sum(len(c) for c in held_completions), "teacher": teacher_info,
              "before_training": before, "runs": runs, "summary": summary, "setup_seconds": setup_seconds,
              "wall_seconds": time.perf_counter() - started}
    print_table(report)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.json}")
    return report


def print_table(report: dict[str, Any]) -> None:
    """The summary: per run, the mean over run seeds and (with several) the min–max range."""
    teacher = report["teacher"]
    line = (f"task {report['task']}: teacher entropy {teacher['teacher_entropy']:.3f} nats/token, top-K mass "
            + ", ".join(f"K={k}: {v:.3f}" for k, v in teacher["teacher_top_k_mass"].items()))
    if "language_entropy" in teacher:
        line += (f"; language entropy {teacher['language_entropy']:.3f}, "
                 f"KL(language‖teacher) {teacher['kl_language_teacher']:.4f}")
    print(line)

    def show(s: dict[str, float]) -> str:
        return f"{s['mean']:.4f}" + (f" [{s['min']:.4f}, {s['max']:.4f}]" if s["min"] != s["max"] else "")

    print(f"{'run':<16} {'steps':>5} {'tok/s':>8} {'tok/s@median':>12}  {'held-out KL(t‖s)':<26} "
          f"held-out JSD(β={report['args']['beta']})")
    for name, s in report["summary"].items():
        tps = f"{s['trained_tokens_per_s']['mean']:.0f}" if "trained_tokens_per_s" in s else ""
        median = f"{s['trained_tokens_per_s_median_step']['mean']:.0f}" if "trained_tokens_per_s" in s else ""
        print(f"{name:<16} {s.get('steps', ''):>5} {tps:>8} {median:>12}  {show(s['held_out_forward_kl']):<26} "
              f"{show(s['held_out_jsd'])}")


if __name__ == "__main__":
    main()
