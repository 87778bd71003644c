"""Reverse-KL and forward-KL estimators against controlled staleness: held-out divergence after a fixed number of
steps, and each estimator's gradient bias and variance against the exact (dense) gradient.

CPU, no servers. The task (``estimator_task.py``) is the zipf language of ``bench_hidden_teacher.py``
(``ZipfLanguage``) at a small size (8 topics, 64 words, 32 per topic; completions of 6–14 words then eos; 75 token
ids), so that the teacher's full distribution and every dense gradient are exact and cheap:

- **teacher**: the language's own next-token distribution smoothed with 5 % of uniform mass (so every token has a
  finite log-prob): 2.94 nats per position on the held-out completions, and its top-8 holds 67 % of the mass, so a
  top-K list with K = 8 is a real truncation. It is a hidden-state teacher: one-hot state rows and a
  ``(V, states)`` head holding the log-probs, so ``dense_teacher_jsd_loss`` computes the exact divergences.
- **student**: embeddings of the topic, the previous token and the position, a tanh layer (32) and a narrow
  lm_head input (8 dims), so it cannot represent the teacher exactly and forward and reverse KL have different
  optima.
- **staleness** is controlled: at optimizer step t the rollouts are sampled from the student's weights of step
  ``t − lag`` (a queue of weight snapshots; the first ``lag`` steps use the initial weights), for lag in
  ``--lags``. The loss is taken at the current weights; the rollout's log-probs μ are the stale policy's.
- **estimators** (``ESTIMATORS``) see the teacher the way the wire gives it: top-K (K = 8, ``Settings``) plus the
  realised token, the teacher's log-probs at student-chosen query ids, S draws from the teacher, or (dense) the
  whole distribution.

Measured, per (estimator, lag) over ``--seeds`` seeds (student initialisation, prompts, sampling):

1. after ``--steps`` Adam steps of ``--batch`` rollouts: the held-out forward KL(π_T‖π_θ) and reverse
   KL(π_θ‖π_T), full vocabulary, nats per token, at the positions of fixed teacher completions of held-out prompts,
   and the reverse KL on the student's own completions of those prompts (the on-policy objective);
2. at fixed weights θ (``--grad-warm-steps`` dense forward-KL steps from the seed-0 initialisation) and rollouts
   from θ's snapshot ``lag`` steps earlier: over ``--grad-rollouts`` rollout batches, bias = ‖E[ĝ] − g‖/‖g‖ and
   variance = E‖ĝ − E ĝ‖²/‖g‖² per batch, g = the dense reverse-KL (forward-KL for the forward estimators)
   gradient over all student parameters on rollouts of θ itself (on-policy states, ``--grad-ref-rollouts``
   batches). ``bias_noise`` is the Monte Carlo standard error of the bias figure; a bias below about twice it is
   not resolved. With the same batches: the fraction of tokens PPO-clip clips and M2PO masks.

The training runs go to ``--workers`` processes (one thread each) while the main one measures the gradients; the
table is printed, the JSON written to ``--json`` and the plot (held-out reverse KL against staleness, one line per
estimator) to ``--plot``. Every estimator is the library's (``fastdistill.loss``) except ``ppo_clip_rollout_adv``,
a local reference of the async-RL recipe (advantage frozen at rollout time), which the library has no option for.

    python benchmarks/bench_estimators.py    # 168 runs of 1-3 CPU-s each; ~25 min wall on 2 cores at load 10-19
    python benchmarks/bench_estimators.py --quick    # seconds of CPU (the smoke test)
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import platform
import sys
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from datetime import UTC, datetime
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from estimator_task import Rollouts, Settings, Student, World, build_world, held_out_metrics  # noqa: E402

DEFAULT_JSON = HERE / "results" / "bench_estimators.json"
DEFAULT_PLOT = HERE / "plots" / "bench_estimators_reverse_kl.png"


# ---------------------------------------------------------------------------------------------- the estimators


def wire_topk(teacher_lps: torch.Tensor, token: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's top-``k`` plus the realised token when outside it (-1 / -inf otherwise): the K+1 layout of
    ``fastdistill_testing.synthetic.score_completion`` and the rollout worker."""
    top_lps, top_ids = teacher_lps.topk(k, dim=-1)
    in_top = (top_ids == token[:, None]).any(dim=-1)
    extra_ids = torch.where(in_top, -1, token)
    extra_lps = torch.where(in_top, float("-inf"), teacher_lps.gather(1, token[:, None]).squeeze(1))
    return torch.cat([top_ids, extra_ids[:, None]], 1), torch.cat([top_lps, extra_lps[:, None]], 1)


def student_queries(r: Rollouts, kind: str, count: int, generator: torch.Generator) -> torch.Tensor:
    """(N, S) query ids from the rollout policy μ: ``"samples"`` (column 0 the realised token, S − 1 more draws,
    duplicates allowed) or ``"topk"`` (μ's top-S), as the student server reports them."""
    if kind == "topk":
        return r.behaviour.topk(count, dim=-1).indices
    if count == 1:
        return r.token[:, None]
    extra = torch.multinomial(r.behaviour.exp(), count - 1, replacement=True, generator=generator)
    return torch.cat([r.token[:, None], extra], 1)


def rollout_advantage_ppo_loss(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, token: torch.Tensor,
                               behaviour_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor,
                               clip_eps: float) -> torch.Tensor:
    """LOCAL REFERENCE (the library recomputes the advantage at learner time by design, so it has no such option):
    the async-RL recipe, PPO-clip with the advantage frozen at rollout time, A = log π_T(y) − log μ(y), summed over
    the N sampled tokens: −Σ min(r·A, clip(r, 1 − ε, 1 + ε)·A), r = π_θ(y)/μ(y)."""
    logprob = torch.log_softmax(hidden @ weight.T + bias, dim=-1).gather(1, token[:, None]).squeeze(1)
    advantage = teacher_logprobs - behaviour_logprobs
    ratio = torch.exp(logprob - behaviour_logprobs)
    return -torch.minimum(ratio * advantage, ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantage).sum()


@dataclasses.dataclass(frozen=True)
class Estimator:
    """One loss: its family (the dense gradient it estimates), what the teacher must send, and the loss function
    ``(student, rollouts, teacher, settings, generator) -> summed loss``."""

    name: str
    family: str  # "forward" or "reverse"
    wire: str
    loss: Callable[..., torch.Tensor]


def _head(student: Student, r: Rollouts) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return student.hidden(r.topic, r.prev, r.pos), student.head.weight, student.head.bias


def _dense(beta: float) -> Callable[..., torch.Tensor]:
    def loss(student, r, teacher, s, g):
        from fastdistill.loss import dense_teacher_jsd_loss

        h, w, b = _head(student, r)
        return dense_teacher_jsd_loss(h, w, teacher.hidden(r.topic, r.prev, r.pos), teacher.head, student_bias=b,
                                      beta=beta, backend="torch").loss
    return loss


def _topk(beta: float) -> Callable[..., torch.Tensor]:
    def loss(student, r, teacher, s, g):
        from fastdistill.loss import sparse_jsd_loss

        h, w, b = _head(student, r)
        ids, lps = wire_topk(teacher.logprobs(r.topic, r.prev, r.pos), r.token, s.top_k)
        return sparse_jsd_loss(h, w, ids, lps, ids >= 0, bias=b, beta=beta, backend="torch").loss
    return loss


def _realised_rkl(student, r, teacher, s, g):
    """What the trainer's ``jsd`` at β = 1 computes from a top-K teacher: ``narrow_support`` keeps the realised
    token only, then the reverse KL over {realised, tail}."""
    from fastdistill.loss import narrow_support, sparse_jsd_loss

    h, w, b = _head(student, r)
    ids, lps = wire_topk(teacher.logprobs(r.topic, r.prev, r.pos), r.token, s.top_k)
    ids, lps, mask = narrow_support(ids, lps, r.token, 1.0)
    return sparse_jsd_loss(h, w, ids, lps, mask, bias=b, beta=1.0, backend="torch").loss


def _single_sample(student, r, teacher, s, g):
    from fastdistill.loss import reverse_kl_pg_loss

    h, w, b = _head(student, r)
    teacher_lp = teacher.logprobs(r.topic, r.prev, r.pos).gather(1, r.token[:, None]).squeeze(1)
    return reverse_kl_pg_loss(h, w, r.token, teacher_lp, bias=b).loss


def _teacher_sampled(student, r, teacher, s, g):
    from fastdistill.loss import sample_teacher_candidates, sampled_kd_loss

    h, w, b = _head(student, r)
    c = sample_teacher_candidates(teacher.logprobs(r.topic, r.prev, r.pos), s.teacher_samples, generator=g)
    return sampled_kd_loss(h, w, c.ids, c.log_weights, teacher_logprobs=c.teacher_logprobs, bias=b).loss


def _query(estimator: str, kind: str, count: Callable[[Settings], int], stabilizer: str = "none"):
    def loss(student, r, teacher, s, g):
        from fastdistill.loss.estimators import query_reverse_kl_loss

        h, w, b = _head(student, r)
        ids = student_queries(r, kind, count(s), g)
        teacher_lps = teacher.logprobs(r.topic, r.prev, r.pos).gather(1, ids)
        return query_reverse_kl_loss(h, w, ids, r.behaviour.gather(1, ids), teacher_lps, estimator=estimator,
                                     bias=b, stabilizer=stabilizer, clip_eps=s.clip_eps,
                                     m2po_budget=s.m2po_budget).loss
    return loss


def _rollout_advantage_ppo(student, r, teacher, s, g):
    h, w, b = _head(student, r)
    teacher_lp = teacher.logprobs(r.topic, r.prev, r.pos).gather(1, r.token[:, None]).squeeze(1)
    behaviour = r.behaviour.gather(1, r.token[:, None]).squeeze(1)
    return rollout_advantage_ppo_loss(h, w, b, r.token, behaviour, teacher_lp, s.clip_eps)


ESTIMATORS = {e.name: e for e in (
    Estimator("dense_fkl", "forward", "hidden-state teacher (or full prompt_logprobs)", _dense(0.0)),
    Estimator("topk_fkl", "forward", "teacher top-K + realised token (stock vLLM)", _topk(0.0)),
    Estimator("teacher_sampled_fkl", "forward", "S teacher draws per position (cache from the full distribution)",
              _teacher_sampled),
    Estimator("dense_rkl", "reverse", "hidden-state teacher (or full prompt_logprobs)", _dense(1.0)),
    # sparse_jsd_loss at β = 1 over the whole top-K ∪ realised row (+ tail): AsyncOPD's sparse reverse KL
    Estimator("topk_rkl", "reverse", "teacher top-K + realised token (stock vLLM)", _topk(1.0)),
    Estimator("realised_rkl", "reverse", "teacher log-prob of the realised token (stock vLLM)", _realised_rkl),
    Estimator("single_sample_rkl", "reverse", "teacher log-prob of the realised token (stock vLLM)",
              _single_sample),
    Estimator("single_sample_is", "reverse", "teacher log-prob of the realised token, student's log μ",
              _query("multi_sample", "samples", lambda s: 1)),
    Estimator("multi_sample_rkl", "reverse", "teacher log-probs at S student draws (query scoring)",
              _query("multi_sample", "samples", lambda s: s.mc_samples)),
    Estimator("student_topk_rkl", "reverse", "teacher log-probs at the student's top-S (query scoring)",
              _query("student_topk", "topk", lambda s: s.student_top_k)),
    Estimator("ppo_clip", "reverse", "teacher log-prob of the realised token, student's log μ",
              _query("multi_sample", "samples", lambda s: 1, "ppo_clip")),
    Estimator("decoupled_ppo", "reverse", "teacher log-prob of the realised token, student's log μ",
              _query("multi_sample", "samples", lambda s: 1, "decoupled_ppo")),
    Estimator("m2po", "reverse", "teacher log-prob of the realised token, student's log μ",
              _query("multi_sample", "samples", lambda s: 1, "m2po")),
    Estimator("ppo_clip_rollout_adv", "reverse", "teacher log-prob of the realised token, student's log μ",
              _rollout_advantage_ppo),
)}
LOCAL_REFERENCES = ("ppo_clip_rollout_adv",)


# ---------------------------------------------------------------------------------------------- runs


def train(world: World, estimator: Estimator, lag: int, seed: int, steps: int, batch: int,
          keep_snapshots: bool = False) -> tuple[Student, list[dict[str, torch.Tensor]]]:
    """``steps`` Adam steps of ``estimator`` (loss per token of the batch) on rollouts of the student's weights
    ``lag`` steps old. The prompts and draws depend on ``seed`` only, so every estimator sees the same stream."""
    student = world.student(seed)
    behaviour = world.student(seed)
    optimizer = torch.optim.Adam(student.parameters(), lr=world.s.lr)
    snapshots: deque[dict[str, torch.Tensor]] = deque([copy.deepcopy(student.state_dict())],
                                                      maxlen=None if keep_snapshots else lag + 1)
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        behaviour.load_state_dict(snapshots[-1 - lag] if len(snapshots) > lag else snapshots[0])
        r = world.rollouts(behaviour, batch, rng, g)
        loss = estimator.loss(student, r, world.teacher, world.s, g) / len(r.token)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        snapshots.append(copy.deepcopy(student.state_dict()))
    return student, list(snapshots)


def flat_gradient(world: World, estimator: Estimator, student: Student, r: Rollouts,
                  g: torch.Generator) -> torch.Tensor:
    """The per-token loss's gradient over every student parameter, flattened, float64."""
    student.zero_grad()
    (estimator.loss(student, r, world.teacher, world.s, g) / len(r.token)).backward()
    return torch.cat([p.grad.flatten() for p in student.parameters()]).double()


@torch.no_grad()
def stabilizer_fraction(world: World, student: Student, r: Rollouts, stabilizer: str) -> float:
    """The fraction of the sampled tokens whose gradient ``stabilizer`` removes at the current weights: clipped
    (PPO-clip) or masked (M2PO)."""
    from fastdistill.loss.estimators import query_reverse_kl_loss

    h, w, b = _head(student, r)
    ids = r.token[:, None]
    out = query_reverse_kl_loss(h, w, ids, r.behaviour.gather(1, ids),
                                world.teacher.logprobs(r.topic, r.prev, r.pos).gather(1, ids), bias=b,
                                stabilizer=stabilizer, clip_eps=world.s.clip_eps, m2po_budget=world.s.m2po_budget)
    return float(out.clipped + out.masked) / float(out.num_queries)


def gradient_study(world: World, names: list[str], lags: list[int], warm_steps: int, batch: int, rollouts: int,
                   ref_rollouts: int) -> dict[str, Any]:
    """Bias and variance of each estimator's gradient at the weights θ after ``warm_steps`` dense forward-KL steps
    (seed 0), on rollouts of θ's snapshot ``lag`` steps earlier, against the dense gradient of its family on
    rollouts of θ. All estimators of one lag see the same ``rollouts`` batches."""
    student, snapshots = train(world, ESTIMATORS["dense_fkl"], 0, 0, warm_steps, batch, keep_snapshots=True)
    stale = world.student(0)
    reference: dict[str, Any] = {}
    rng, g = np.random.default_rng(7), torch.Generator().manual_seed(7)
    for family, name in (("forward", "dense_fkl"), ("reverse", "dense_rkl")):
        grads = torch.stack([flat_gradient(world, ESTIMATORS[name], student, world.rollouts(student, batch, rng, g),
                                           g) for _ in range(ref_rollouts)])
        mean = grads.mean(0)
        reference[family] = {"mean": mean, "variance": float(((grads - mean) ** 2).sum(1).mean())}
    out: dict[str, Any] = {"warm_steps": warm_steps, "batch": batch, "rollouts": rollouts,
                           "ref_rollouts": ref_rollouts,
                           "reference_norm": {f: float(v["mean"].norm()) for f, v in reference.items()}, "by_lag": {},
                           "stabilizer_fraction": {}}
    for lag in lags:
        stale.load_state_dict(snapshots[max(0, len(snapshots) - 1 - lag)])
        rng, g = np.random.default_rng(100 + lag), torch.Generator().manual_seed(100 + lag)
        batches = [world.rollouts(stale, batch, rng, g) for _ in range(rollouts)]
        rows = {}
        for name in names:
            est = ESTIMATORS[name]
            grads = torch.stack([flat_gradient(world, est, student, r, g) for r in batches])
            ref = reference[est.family]
            norm2 = float(ref["mean"].norm() ** 2)
            mean = grads.mean(0)
            variance = float(((grads - mean) ** 2).sum(1).mean()) / norm2
            rows[name] = {"bias": float((mean - ref["mean"]).norm()) / norm2**0.5, "variance": variance,
                          "bias_noise": (variance / rollouts + ref["variance"] / norm2 / ref_rollouts) ** 0.5}
        out["by_lag"][str(lag)] = rows
        out["stabilizer_fraction"][str(lag)] = {
            name: float(np.mean([stabilizer_fraction(world, student, r, name) for r in batches]))
            for name in ("ppo_clip", "m2po") if name in names}
    return out


def run_job(name: str, lag: int, seed: int, steps: int, batch: int, held_out: int) -> dict[str, Any]:
    """One training run and its held-out metrics (in a worker process: the world is rebuilt, deterministically)."""
    world = build_world(Settings(), held_out)
    started = time.perf_counter()
    student, _ = train(world, ESTIMATORS[name], lag, seed, steps, batch)
    return ({"estimator": name, "lag": lag, "seed": seed, "seconds": time.perf_counter() - started}
            | held_out_metrics(world, student, seed))


def mean_std(values: list[float]) -> dict[str, float]:
    """Mean and (population) standard deviation across seeds."""
    return {"mean": float(np.mean(values)), "std": float(np.std(values))}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--estimators", nargs="+", choices=list(ESTIMATORS), default=list(ESTIMATORS))
    parser.add_argument("--lags", type=int, nargs="+", default=[0, 1, 2, 4], help="rollout staleness, in steps")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=150, help="optimizer steps per run")
    parser.add_argument("--batch", type=int, default=32, help="completions per step")
    parser.add_argument("--held-out", type=int, default=512, help="held-out prompts")
    parser.add_argument("--grad-lags", type=int, nargs="+", default=[0, 4])
    parser.add_argument("--grad-warm-steps", type=int, default=40)
    parser.add_argument("--grad-rollouts", type=int, default=200, help="rollout batches per gradient estimate")
    parser.add_argument("--grad-ref-rollouts", type=int, default=400, help="batches of the dense reference")
    parser.add_argument("--workers", type=int, default=2, help="processes for the training runs (0: this one)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes for a smoke test (seconds)")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    parser.add_argument("--plot", type=str, default=str(DEFAULT_PLOT), help="PNG path ('' for none)")
    parser.add_argument("--replot", type=Path, default=None, help="only draw --plot from this JSON report")
    args = parser.parse_args(argv)
    if args.replot is not None:
        report = json.loads(args.replot.read_text())
        plot(report, Path(args.plot or DEFAULT_PLOT))
        return report
    if args.quick:
        args.seeds, args.steps, args.batch, args.held_out, args.workers = args.seeds[:1], 3, 4, 16, 0
        args.grad_warm_steps, args.grad_rollouts, args.grad_ref_rollouts = max(args.grad_lags), 3, 3
    if min(args.lags + args.grad_lags) < 0 or args.grad_warm_steps < max(args.grad_lags):
        parser.error("lags must be ≥ 0 and --grad-warm-steps ≥ the largest --grad-lags")
    torch.set_num_threads(1)
    started = time.perf_counter()
    s = Settings()
    world = build_world(s, args.held_out)
    teacher_lps = world.teacher.logprobs(world.held_teacher.topic, world.held_teacher.prev, world.held_teacher.pos)
    teacher_info = {"entropy": float(-(teacher_lps.exp() * teacher_lps).sum(-1).mean()),
                    "top_k_mass": float(teacher_lps.exp().topk(s.top_k, dim=-1).values.sum(-1).mean()),
                    "held_out_tokens": len(world.held_teacher.token), "vocab_size": world.language.vocab_size}
    before = {str(seed): held_out_metrics(world, world.student(seed), seed) for seed in args.seeds}

    jobs = [(name, lag, seed, args.steps, args.batch, args.held_out)
            for name in args.estimators for lag in args.lags for seed in args.seeds]
    # the runs go to worker processes while this one measures the gradients (tiny tensors: one thread each)
    def measure_gradients() -> dict[str, Any]:
        return gradient_study(world, args.estimators, args.grad_lags, args.grad_warm_steps, args.batch,
                              args.grad_rollouts, args.grad_ref_rollouts)

    if args.workers == 0:
        runs = [run_job(*job) for job in jobs]
        gradients = measure_gradients()
    else:
        with ProcessPoolExecutor(args.workers, mp_context=get_context("spawn"), initializer=torch.set_num_threads,
                                 initargs=(1,)) as pool:
            pending = [pool.submit(run_job, *job) for job in jobs]
            gradients = measure_gradients()
            runs = [future.result() for future in pending]
    for name in args.estimators:
        done = [r for r in runs if r["estimator"] == name]
        means = [np.mean([r["held_out_reverse_kl"] for r in done if r["lag"] == lag]) for lag in args.lags]
        cells = [f"lag {lag} {m:.4f}" for lag, m in zip(args.lags, means, strict=True)]
        print(f"{name}: held-out KL(S‖T) " + ", ".join(cells), flush=True)
    keys = ("held_out_forward_kl", "held_out_reverse_kl", "on_policy_reverse_kl")
    summary = {name: {str(lag): {k: mean_std([r[k] for r in runs if r["estimator"] == name and r["lag"] == lag])
                                 for k in keys} for lag in args.lags} for name in args.estimators}
    report = {"benchmark": "bench_estimators", "date": datetime.now(UTC).isoformat(timespec="seconds"),
              "machine": {"platform": platform.platform(), "threads": torch.get_num_threads(), "device": "cpu"},
              "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "settings": dataclasses.asdict(s), "teacher": teacher_info,
              "estimators": {name: {"family": ESTIMATORS[name].family, "wire": ESTIMATORS[name].wire,
                                    "implementation": "local reference (bench_estimators.rollout_advantage_ppo_loss)"
                                    if name in LOCAL_REFERENCES else "fastdistill.loss"}
                             for name in args.estimators},
              "before_training": {k: mean_std([b[k] for b in before.values()]) for k in keys},
              "runs": runs, "summary": summary, "gradients": gradients,
              "wall_seconds": time.perf_counter() - started}
    print_table(report)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.json}")
    if args.plot:
        plot(report, Path(args.plot))
    return report


def print_table(report: dict[str, Any]) -> None:
    """Per estimator and lag: held-out KLs (mean ± std over seeds); then the gradient bias and variance."""
    t = report["teacher"]
    print(f"teacher entropy {t['entropy']:.3f} nats/token, top-{report['settings']['top_k']} mass "
          f"{t['top_k_mass']:.3f}, V = {t['vocab_size']}; before training: held-out KL(T‖S) "
          f"{report['before_training']['held_out_forward_kl']['mean']:.4f}, KL(S‖T) "
          f"{report['before_training']['held_out_reverse_kl']['mean']:.4f}")
    print(f"{'estimator':<20} {'lag':>3}  {'held-out KL(T‖S)':<18} {'held-out KL(S‖T)':<18} {'on-policy KL(S‖T)':<18}")
    for name, by_lag in report["summary"].items():
        for lag, row in by_lag.items():
            cells = [f"{row[k]['mean']:.4f} ± {row[k]['std']:.4f}"
                     for k in ("held_out_forward_kl", "held_out_reverse_kl", "on_policy_reverse_kl")]
            print(f"{name:<20} {lag:>3}  {cells[0]:<18} {cells[1]:<18} {cells[2]:<18}")
    grads = report["gradients"]
    lags = list(grads["by_lag"])
    print(f"gradient at fixed weights ({grads['warm_steps']} dense forward-KL steps), per batch of "
          f"{grads['batch']} completions, {grads['rollouts']} batches: bias / variance (relative to ‖g‖, ‖g‖²)")
    print(f"{'estimator':<20} " + " ".join(f"{'lag ' + lag + ' bias':>16} {'variance':>9}" for lag in lags))
    for name in report["summary"]:
        cells = []
        for lag in lags:
            row = grads["by_lag"][lag][name]
            cells.append(f"{row['bias']:>9.3f} ±{row['bias_noise']:.3f} {row['variance']:>9.3f}")
        print(f"{name:<20} " + " ".join(cells))
    for lag, fractions in grads["stabilizer_fraction"].items():
        print(f"lag {lag}: tokens whose gradient the stabilizer removes: "
              + ", ".join(f"{name} {value:.1%}" for name, value in fractions.items()))


def plot(report: dict[str, Any], path: Path) -> None:
    """Held-out reverse KL (at the teacher's completions) against staleness, one line per estimator (mean ± std
    over seeds; dashed: the forward-KL estimators)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=80)
    for index, (name, by_lag) in enumerate(report["summary"].items()):
        lags = [int(lag) for lag in by_lag]
        mean = np.array([by_lag[str(lag)]["held_out_reverse_kl"]["mean"] for lag in lags])
        std = np.array([by_lag[str(lag)]["held_out_reverse_kl"]["std"] for lag in lags])
        style = "--" if report["estimators"][name]["family"] == "forward" else "-"
        ax.errorbar(lags, mean, yerr=std, label=name, linestyle=style, marker="o", markersize=3, capsize=2,
                    color=plt.cm.tab20(index % 20))
    ax.set_xlabel("staleness (optimizer steps between the rollout's weights and the trained ones)")
    ax.set_ylabel("held-out KL(student‖teacher), nats/token")
    ax.set_yscale("log")
    ax.set_xticks(lags)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    ax.set_title(f"after {report['args']['steps']} steps, mean ± std over {len(report['args']['seeds'])} seeds",
                 fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
