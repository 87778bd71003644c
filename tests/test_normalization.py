"""Window-level normalisation: a token mean over the whole accumulation window across ranks."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from loss_cases import make_case

from fastdistill import scored_positions, sparse_jsd_loss, window_loss_scale, window_token_count

D, V = 8, 40
# per rank, per micro-batch: number of positions (deliberately skewed: 1 vs 9 tokens)
MICROBATCHES = {0: [1, 9], 1: [4, 3]}


def _microbatch(rank: int, k: int):
    case = make_case(seed=100 * rank + k, N=MICROBATCHES[rank][k], D=D, V=V, K=4, empty_rows=0)
    return case.hidden.float(), *case.narrowed(0.0)


def _model():
    torch.manual_seed(0)
    return torch.nn.Linear(D, D), torch.nn.Parameter(torch.randn(V, D) / D**0.5)


def _window_grads(rank: int) -> list[torch.Tensor]:
    """One rank's accumulation window, gradients averaged over ranks as DDP/FSDP do."""
    backbone, head = _model()
    batches = [_microbatch(rank, k) for k in range(len(MICROBATCHES[rank]))]
    total = window_token_count([scored_positions(ids, lps, mask) for _, ids, lps, mask in batches])
    scale = window_loss_scale(total)
    for x, ids, lps, mask in batches:
        (sparse_jsd_loss(backbone(x), head, ids, lps, mask).loss * scale).backward()
    grads = [p.grad for p in (*backbone.parameters(), head)]
    if dist.is_initialized():
        for g in grads:
            dist.all_reduce(g)
            g /= dist.get_world_size()
    return grads


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.save(_window_grads(rank), os.path.join(out_dir, f"grads{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _token_mean_grads() -> list[torch.Tensor]:
    """Oracle: every micro-batch of every rank in one batch, summed loss / total tokens."""
    backbone, head = _model()
    parts = [_microbatch(r, k) for r in MICROBATCHES for k in range(len(MICROBATCHES[r]))]
    x, ids, lps, mask = (torch.cat(t) for t in zip(*parts, strict=True))
    out = sparse_jsd_loss(backbone(x), head, ids, lps, mask)
    (out.loss / out.num_tokens).backward()
    return [p.grad for p in (*backbone.parameters(), head)]


@pytest.mark.slow
def test_two_rank_window_equals_global_token_mean(tmp_path):
    mp.start_processes(_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, start_method="spawn")
    expected = _token_mean_grads()
    for rank in range(2):
        for g, e in zip(torch.load(tmp_path / f"grads{rank}.pt"), expected, strict=True):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-7)


def test_single_process_window_scale():
    assert window_token_count([3, torch.tensor(4)]) == 7
    assert window_loss_scale(7) == pytest.approx(1 / 7)
    assert window_loss_scale(0) == 1.0


@pytest.mark.parametrize("bad", [-1, 2.5, True, "3"])
def test_window_loss_scale_rejects_bad_counts(bad):
    with pytest.raises(ValueError, match="window_tokens must be an int >= 0"):
        window_loss_scale(bad)
