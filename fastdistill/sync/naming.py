"""What a weight sync sends: the Hugging Face names, dtypes and shapes of a model's weights, and the tensors.

A *weight source* is either a ``torch.nn.Module`` (its parameters, under their Hugging Face names) or a
:class:`NamedTensors` (a list of ``(hf_name, tensor)``, or a stream that makes them one at a time, e.g. merged
LoRA weights).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator

import torch

from fastdistill.sync.transport import TensorSpec

# Wrapper segments that activation checkpointing, torch.compile, FSDP1 and DDP add to parameter names; vLLM's
# load_weights expects the plain Hugging Face names.
_WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def hf_name(name: str) -> str:
    """Strip wrapper segments (checkpoint wrapper, ``torch.compile``, FSDP1, a leading DDP ``module.``)."""
    for segment in _WRAPPER_SEGMENTS:
        name = name.replace(segment, "")
    return name.removeprefix("module.")


class NamedTensors:
    """``(hf_name, tensor)`` pairs that :meth:`VLLMWeightSync.push` accepts in place of a model.

    ``NamedTensors(pairs)`` holds a fixed list (a snapshot taken on the training thread and sent from another, or
    weights that come as an iterator, like TRL's ``send_weights``). :meth:`stream` wraps a function that makes the
    pairs one at a time on each pass, together with their manifest, so that a push never holds more than one of
    them (plus the chunk being sent).
    """

    def __init__(self, tensors: Iterable[tuple[str, torch.Tensor]]):
        self.tensors: list[tuple[str, torch.Tensor]] | None = list(tensors)
        self._produce: Callable[[], Iterable[tuple[str, torch.Tensor]]] | None = None
        self._manifest: list[TensorSpec] | None = None

    @classmethod
    def stream(
        cls, produce: Callable[[], Iterable[tuple[str, torch.Tensor]]], manifest: list[TensorSpec]
    ) -> NamedTensors:
        """Pairs made on demand: every pass calls ``produce()`` afresh; ``manifest`` lists what it yields, in order."""
        streamed = cls(())
        streamed.tensors, streamed._produce, streamed._manifest = None, produce, list(manifest)
        return streamed

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.tensors if self.tensors is not None else self._produce())  # type: ignore[misc]

    def manifest(self) -> list[TensorSpec]:
        """Names, dtypes and shapes of the pairs, in order (for a list, read from the tensors)."""
        if self._manifest is not None:
            return list(self._manifest)
        return [TensorSpec(name, tensor.dtype, tuple(tensor.shape)) for name, tensor in self]

    def named_parameters(self, remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """The pairs, like ``nn.Module.named_parameters`` (for code written against modules)."""
        return iter(self)


WeightSource = torch.nn.Module | NamedTensors


class GatherClock:
    """Where a push's FSDP all-gathers stand (the trainer ranks' own collectives, not the student's part): the
    parameter being gathered now (``current``, None between gathers) and since when, the one whose gather raised
    (``failed``), and the seconds spent gathering (:meth:`seconds`)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.current: str | None = None
        self.failed: str | None = None
        self.started = 0.0
        self._total_s = 0.0

    @contextlib.contextmanager
    def gathering(self, name: str) -> Iterator[None]:
        self.current, self.started = name, self.clock()
        try:
            yield
        except BaseException:
            self.failed = name
            raise
        finally:
            self._total_s += self.clock() - self.started
            self.current = None

    def seconds(self) -> float:
        """Seconds spent in gathers so far, the one running included."""
        running = self.clock() - self.started if self.current is not None else 0.0
        return self._total_s + running

    def running_s(self) -> float:
        """Seconds the gather running now has taken (0 between gathers)."""
        return self.clock() - self.started if self.current is not None else 0.0


def _cast_dtype(tensor_dtype: torch.dtype, dtype: torch.dtype | None) -> torch.dtype:
    """``dtype`` for floating-point tensors (the server's), anything else as it is."""
    return dtype if dtype is not None and tensor_dtype.is_floating_point else tensor_dtype


def _named_parameters(model: torch.nn.Module, include_tied: bool) -> list[tuple[str, torch.nn.Parameter]]:
    return [(hf_name(name), p) for name, p in model.named_parameters(remove_duplicate=not include_tied)]


def weight_manifest(
    model: WeightSource, *, include_tied: bool = False, dtype: torch.dtype | None = None
) -> list[TensorSpec]:
    """What :func:`iter_named_weights` will yield (names, dtypes, full shapes), without gathering anything."""
    if isinstance(model, NamedTensors):
        return [TensorSpec(s.name, _cast_dtype(s.dtype, dtype), s.shape) for s in model.manifest()]
    named = _named_parameters(model, include_tied)
    return [TensorSpec(name, _cast_dtype(p.dtype, dtype), tuple(p.shape)) for name, p in named]


def iter_named_weights(
    model: WeightSource, *, include_tied: bool = False, dtype: torch.dtype | None = None,
    gathers: GatherClock | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full_tensor)`` for every parameter, one at a time, detached.

    Names are the Hugging Face names vLLM's ``load_weights`` expects. FSDP2 ``DTensor`` parameters are all-gathered
    with ``full_tensor()``: a collective, so every rank of the mesh must run this iteration in lockstep. A tied
    parameter is yielded once under its first name (``model.embed_tokens.weight``), like ``named_parameters()``;
    ``include_tied=True`` also yields its aliases (``lm_head.weight``), as ``state_dict()`` would. ``dtype`` casts
    each floating-point tensor (e.g. fp32 master weights to a bf16 server). A :class:`NamedTensors` yields its pairs
    (``include_tied`` does not apply). ``gathers`` records the all-gathers (a stall there is the trainer ranks',
    not the server's).
    """
    pairs = iter(model) if isinstance(model, NamedTensors) else iter(_named_parameters(model, include_tied))
    for name, param in pairs:
        with torch.no_grad():
            full_tensor = getattr(param, "full_tensor", None)
            if callable(full_tensor):
                with gathers.gathering(name) if gathers is not None else contextlib.nullcontext():
                    tensor = full_tensor()
            else:
                tensor = param
            tensor = tensor.detach()
            target = _cast_dtype(tensor.dtype, dtype)
            if tensor.dtype != target:
                tensor = tensor.to(target)
        yield name, tensor


def snapshot_weights(model: WeightSource, *, include_tied: bool = False) -> NamedTensors:
    """A copy of ``model``'s weights now (cloned tensors), to push from another thread while training goes on."""
    weights = iter_named_weights(model, include_tied=include_tied)
    return NamedTensors([(name, tensor.clone()) for name, tensor in weights])
