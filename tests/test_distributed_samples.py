"""Samples between ranks as tensors: the arrays of RolloutSample travel as uint8 tensors, only a small skeleton is
pickled (its size does not grow with the hidden-state width); checked alone and with 2 gloo ranks."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fastdistill.rollout import RolloutSample
from fastdistill.train import distributed
from fastdistill.train.distributed import Distributed, broadcast_samples, join_arrays, scatter_samples, split_arrays


def make_samples(count: int, width: int, seed: int = 0, hidden_dtype=np.uint16) -> list[RolloutSample]:
    """``count`` samples of a hidden-state teacher of width ``width`` (bfloat16 bits by default), one of a top-K
    teacher, and lengths that vary."""
    rng = np.random.default_rng(seed)
    samples = []
    for index in range(count):
        prompt, completion = 3 + index % 4, 2 + index % 5
        hidden = index % 3 != 2
        top_k = 0 if hidden else 5
        samples.append(RolloutSample(
            input_ids=rng.integers(0, 1000, prompt + completion).astype(np.int32),
            completion_mask=np.array([0] * prompt + [1] * completion, np.int32),
            teacher_topk_ids=rng.integers(0, 1000, (completion, top_k)).astype(np.int32),
            teacher_topk_logprobs=rng.standard_normal((completion, top_k)).astype(np.float32),
            rollout_logprobs=rng.standard_normal(completion).astype(np.float32),
            model_version=index, teacher_id="hidden" if hidden else "topk", prompt_id=index, dataset_index=10 * index,
            prompt=[{"role": "user", "content": f"question {index}"}], metrics={"rollout/latency_s": 0.5 * index},
            teacher_hidden=hidden_states(rng, (completion, width), hidden_dtype) if hidden else None))
    return samples


def hidden_states(rng: np.random.Generator, shape: tuple[int, int], dtype) -> np.ndarray:
    if dtype == np.uint16:  # bfloat16 bit patterns
        return rng.integers(0, 65535, shape).astype(np.uint16)
    return rng.standard_normal(shape).astype(dtype)


def assert_samples_equal(got: list[RolloutSample], expected: list[RolloutSample]) -> None:
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        for name in RolloutSample.__slots__:
            x, y = getattr(a, name), getattr(b, name)
            if isinstance(y, np.ndarray):
                assert isinstance(x, np.ndarray) and x.dtype == y.dtype and x.shape == y.shape
                assert np.array_equal(x, y), name
            else:
                assert x == y, name


def window(samples: list[RolloutSample]):
    """The trainer's per-rank payload: ``([(row samples, ghost) per micro-batch], total steps)``."""
    return [(samples[:3], False), (samples[3:], True)], 17


# ------------------------------------------------------------------------------------------------ alone


@pytest.mark.parametrize("hidden_dtype", [np.uint16, np.float32])
def test_split_and_join_give_the_samples_back(hidden_dtype):
    samples = make_samples(7, width=24, hidden_dtype=hidden_dtype)
    split = split_arrays(window(samples), chunk_bytes=700)  # several chunks; some arrays alone in theirs
    assert len(split.chunks) > 2
    assert all(isinstance(sample.input_ids, np.ndarray) for sample in samples)  # the inputs are left alone
    # what the receiver rebuilds from the pickled metadata and the chunks' bytes
    received = [distributed._chunk_tensor(split, members, size, torch.device("cpu")).clone()
                for members, size in split.chunks]
    rows, total = distributed._unpack_chunks(pickle.loads(pickle.dumps(split.metadata)), received)
    assert total == 17 and [ghost for _, ghost in rows] == [False, True]
    assert_samples_equal(rows[0][0] + rows[1][0], samples)
    for sample in rows[0][0] + rows[1][0]:  # the received views are aligned for their dtype
        assert all(getattr(sample, name).ctypes.data % getattr(sample, name).dtype.itemsize == 0
                   for name in ("input_ids", "teacher_topk_logprobs") if getattr(sample, name).size)


def test_values_without_arrays_pass_through():
    for payload in (None, 3, [None, None], {"a": (1, "b")}):
        split = split_arrays(payload)
        assert split.arrays == [] and split.chunks == []
        assert join_arrays(split.skeleton, []) == payload


def test_the_pickled_part_does_not_grow_with_the_hidden_width():
    """A 7B teacher's (L, 3584) bfloat16 states are 7 KB per token; the pickled skeleton stays the same size at any
    width (both widths below pickle their shape ints alike) and far below the arrays' bytes."""
    narrow, wide = (split_arrays(window(make_samples(9, width)), chunk_bytes=1 << 30) for width in (512, 4096))
    assert len(pickle.dumps(narrow.metadata)) == len(pickle.dumps(wide.metadata))
    hidden_bytes = sum(array.nbytes for array in wide.arrays)
    assert hidden_bytes > 150_000 and len(pickle.dumps(wide.metadata)) < hidden_bytes / 50


# ------------------------------------------------------------------------------------------------ 2 gloo ranks


def _two_ranks(rank: int, world_size: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        group = Distributed(rank, world_size, torch.device("cpu"))
        distributed.CHUNK_BYTES = 3000  # several chunks per payload
        pickled: list[int] = []
        real_broadcast, real_scatter = dist.broadcast_object_list, dist.scatter_object_list

        def counting_broadcast(objects, src=0, **kwargs):
            if rank == 0:
                pickled.append(len(pickle.dumps(objects)))
            return real_broadcast(objects, src=src, **kwargs)

        def counting_scatter(output, inputs, src=0, **kwargs):
            if rank == 0:
                pickled.append(max(len(pickle.dumps(item)) for item in inputs))
            return real_scatter(output, inputs, src=src, **kwargs)

        dist.broadcast_object_list, dist.scatter_object_list = counting_broadcast, counting_scatter
        sizes = {}
        for width in (512, 4096):
            samples = make_samples(8, width, seed=width)
            pickled.clear()
            got = broadcast_samples(group, samples if rank == 0 else None)
            assert_samples_equal(got, samples)
            per_rank = [window(samples[:5]), window(samples[5:])]
            mine = scatter_samples(group, per_rank if rank == 0 else None)
            rows, total = mine
            expected_rows, _ = per_rank[rank]
            assert total == 17 and [g for _, g in rows] == [g for _, g in expected_rows]
            assert_samples_equal([s for row, _ in rows for s in row], [s for row, _ in expected_rows for s in row])
            assert scatter_samples(group, [None, None] if rank == 0 else None) is None  # the end of a run
            sizes[width] = list(pickled)
        if rank == 0:
            assert sizes[512] == sizes[4096] and len(sizes[512]) == 3, sizes
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_receive_equal_samples_with_a_small_pickle(tmp_path):
    mp.spawn(_two_ranks, args=(2, str(tmp_path / "rendezvous")), nprocs=2, join=True)
