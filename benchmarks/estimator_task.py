"""The task of ``bench_estimators.py``: the small zipf language, its exact (smoothed) teacher as a hidden-state
teacher, the student, sampling completions from a policy, and the held-out divergences."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_hidden_teacher import ZipfLanguage  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Settings:
    """Task and estimator sizes (the run lengths are command-line options)."""

    topics: int = 8
    words: int = 64
    support: int = 32
    min_length: int = 6
    max_length: int = 14
    smoothing: float = 0.05
    trunk: int = 32
    head_dim: int = 8
    top_k: int = 8  # teacher top-K on the wire
    mc_samples: int = 4  # multi-sample MC: draws from μ per position
    student_top_k: int = 8  # student-top-k reverse KL: the rollout student's top-S ids
    teacher_samples: int = 8  # teacher-sampled forward KL: draws from π_T per position
    clip_eps: float = 0.2
    m2po_budget: float = 0.01
    lr: float = 3e-2


class Teacher:
    """The smoothed language as a table of log-probs per state (topic, class of the previous token, position)."""

    def __init__(self, language: ZipfLanguage, smoothing: float):
        self.language = language
        positions = language.max_length + 1
        V = language.vocab_size
        table = np.zeros((language.topics, language.classes, positions, V))
        for topic in range(language.topics):
            prompt = [1, language.first_topic + topic]
            for cls in range(language.classes):
                word = language.first_word + cls
                for j in range(positions):  # the distribution depends on the previous token's class and j only
                    table[topic, cls, j] = language.next_token_probs(prompt + [word], [word] * j)
        table = (1.0 - smoothing) * table + smoothing / V
        self.logprobs_table = torch.from_numpy(np.log(table)).float()  # (topics, classes, positions, V)
        self.num_states = language.topics * language.classes * positions
        # hidden-state teacher: one-hot state rows times a head holding the (normalised) log-probs
        self.head = self.logprobs_table.reshape(self.num_states, V).T.contiguous()  # (V, states)

    def state_index(self, topic: torch.Tensor, prev: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """(N,) long state ids of positions given topic index, previous token id and completion position."""
        lang = self.language
        cls = torch.remainder(prev - lang.first_word, lang.classes)
        return (topic * lang.classes + cls) * (lang.max_length + 1) + pos

    def logprobs(self, topic: torch.Tensor, prev: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """(N, V) float32 log π_T at the positions."""
        return self.head.T[self.state_index(topic, prev, pos)]

    def hidden(self, topic: torch.Tensor, prev: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """(N, states) one-hot rows: ``hidden @ head.T`` is the teacher's log-probs."""
        return torch.nn.functional.one_hot(self.state_index(topic, prev, pos), self.num_states).float()


class Student(torch.nn.Module):
    """Topic, previous-token and position embeddings → tanh → a narrow lm_head input; ``head`` is the lm_head."""

    def __init__(self, vocab: int, topics: int, positions: int, trunk: int, head_dim: int):
        super().__init__()
        self.topic = torch.nn.Embedding(topics, trunk)
        self.prev = torch.nn.Embedding(vocab, trunk)
        self.pos = torch.nn.Embedding(positions, trunk)
        self.proj = torch.nn.Linear(trunk, head_dim)
        self.head = torch.nn.Linear(head_dim, vocab)

    def hidden(self, topic: torch.Tensor, prev: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """(N, head_dim) lm_head inputs."""
        return self.proj(torch.tanh(self.topic(topic) + self.prev(prev) + self.pos(pos)))

    def logprobs(self, topic: torch.Tensor, prev: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """(N, V) log π_θ."""
        return torch.log_softmax(self.head(self.hidden(topic, prev, pos)), dim=-1)


@dataclasses.dataclass
class Rollouts:
    """The positions of a batch of completions, flattened: (N,) topic index, previous token, position, sampled
    token, and μ's full log-probs (N, V) (the rollout policy's, for query draws and ratios)."""

    topic: torch.Tensor
    prev: torch.Tensor
    pos: torch.Tensor
    token: torch.Tensor
    behaviour: torch.Tensor


def prompts_of(language: ZipfLanguage, count: int, rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` prompts as (topic index, last prompt token) tensors — all the state a prompt carries here."""
    prompts = [language.sample_prompt(rng) for _ in range(count)]
    return (torch.tensor([p[1] - language.first_topic for p in prompts]), torch.tensor([p[-1] for p in prompts]))


@torch.no_grad()
def sample_completions(policy: Callable[..., torch.Tensor], topic: torch.Tensor, last: torch.Tensor,
                       max_length: int, eos: int, generator: torch.Generator) -> Rollouts:
    """Completions drawn at temperature 1 from ``policy(topic, prev, pos) -> (n, V) log-probs``, at most
    ``max_length + 1`` tokens each, eos included when drawn."""
    alive = torch.ones(len(topic), dtype=torch.bool)
    prev = last.clone()
    parts: list[tuple[torch.Tensor, ...]] = []
    for j in range(max_length + 1):
        rows = alive.nonzero().squeeze(1)
        if not len(rows):
            break
        pos = torch.full((len(rows),), j)
        logprobs = policy(topic[rows], prev[rows], pos)
        token = torch.multinomial(logprobs.exp(), 1, generator=generator).squeeze(1)
        parts.append((topic[rows], prev[rows], pos, token, logprobs))
        prev[rows] = token
        alive[rows[token == eos]] = False
    return Rollouts(*(torch.cat([p[i] for p in parts]) for i in range(5)))


@dataclasses.dataclass
class World:
    """What every run shares: settings, language, teacher, held-out prompts and the teacher's completions."""

    s: Settings
    language: ZipfLanguage
    teacher: Teacher
    held_topic: torch.Tensor
    held_last: torch.Tensor
    held_teacher: Rollouts

    def student(self, seed: int) -> Student:
        torch.manual_seed(seed)
        lang = self.language
        return Student(lang.vocab_size, lang.topics, lang.max_length + 1, self.s.trunk, self.s.head_dim)

    def rollouts(self, policy: Student, count: int, rng: np.random.Generator, g: torch.Generator) -> Rollouts:
        topic, last = prompts_of(self.language, count, rng)
        return sample_completions(policy.logprobs, topic, last, self.language.max_length, self.language.eos, g)


def build_world(s: Settings, held_out: int, seed: int = 0) -> World:
    """The language (``seed``), its smoothed teacher and ``held_out`` held-out prompts with a teacher completion
    each (drawn at temperature 1)."""
    language = ZipfLanguage(topics=s.topics, words=s.words, support=s.support, min_length=s.min_length,
                            max_length=s.max_length, seed=seed)
    teacher = Teacher(language, s.smoothing)
    topic, last = prompts_of(language, held_out, np.random.default_rng(10_000 + seed))
    completions = sample_completions(teacher.logprobs, topic, last, language.max_length, language.eos,
                                     torch.Generator().manual_seed(10_000 + seed))
    return World(s, language, teacher, topic, last, completions)


@torch.no_grad()
def divergences(world: World, student: Student, r: Rollouts) -> dict[str, float]:
    """Full-vocabulary forward KL(π_T‖π_θ) and reverse KL(π_θ‖π_T) at the positions of ``r``, float64, nats per
    token."""
    p = student.logprobs(r.topic, r.prev, r.pos).double()
    q = world.teacher.logprobs(r.topic, r.prev, r.pos).double()
    return {"forward_kl": float((q.exp() * (q - p)).sum(-1).mean()),
            "reverse_kl": float((p.exp() * (p - q)).sum(-1).mean())}


def held_out_metrics(world: World, student: Student, seed: int) -> dict[str, float]:
    """Held-out forward and reverse KL at the teacher's completions, and the reverse KL at the student's own
    completions of the same prompts (``seed`` fixes its draws)."""
    on_teacher = divergences(world, student, world.held_teacher)
    own = sample_completions(student.logprobs, world.held_topic, world.held_last, world.language.max_length,
                             world.language.eos, torch.Generator().manual_seed(20_000 + seed))
    return {"held_out_forward_kl": on_teacher["forward_kl"], "held_out_reverse_kl": on_teacher["reverse_kl"],
            "on_policy_reverse_kl": divergences(world, student, own)["reverse_kl"]}
