"""The weight sync's HTTP calls to vLLM's dev-mode routes (blocking, through :mod:`fastdistill.http_client`: no
proxy, one error-body parser), with errors that say what to fix."""

from __future__ import annotations

from typing import Any

import torch

from fastdistill.errors import WeightSyncError
from fastdistill.http_client import HTTPFailure, request_json_blocking, unauthorized_hint
from fastdistill.sync.transport import dtype_from_name

CONTROL_TIMEOUT_S = 300.0  # the short control calls: /pause, /start_weight_update, /resume, LoRA loads, checks (TRL's)


def _hint(route: str, error: HTTPFailure, backend: str | None, sent_key: bool) -> str | None:
    flag = f'--weight-transfer-config \'{{"backend": "{backend}"}}\''
    if error.status == 401:
        return unauthorized_hint(sent_key, "set the student's key (vllm_server_api_key, or the environment variable "
                                 "FASTDISTILL_STUDENT_API_KEY or FASTDISTILL_STUDENT_API_KEY_FILE; "
                                 "VLLMWeightSync(api_key=...))")
    if backend is None:  # not a call of the weight-transfer API
        return None
    if error.status == 404:
        return (
            f"the server has no {route} route: vLLM serves its weight-transfer routes only in dev mode, "
            "so start it with the environment variable VLLM_SERVER_DEV_MODE=1"
        )
    if "Weight transfer not configured" in error.message or "weight_transfer_config" in error.message:
        return f"the server was started without a weight-transfer engine: start it with {flag}"
    if "Invalid init_info" in error.message or "Invalid update_info" in error.message:
        return f"the server's weight-transfer engine does not take backend={backend!r} payloads: start it with {flag}"
    return None


def request(
    method: str,
    base_url: str,
    route: str,
    payload: Any = None,
    *,
    timeout_s: float,
    backend: str | None = "gloo",
    api_key: str | None = None,
) -> Any:
    """:func:`~fastdistill.http_client.request_json_blocking` on ``base_url + route`` whose failures are
    :class:`WeightSyncError` with the server's message and, where known, the fix (``backend``: the weight-transfer
    engine the fixes name; None for calls outside the weight-transfer API). The key never appears in a message."""
    try:
        return request_json_blocking(method, base_url + route, payload, timeout_s=timeout_s, api_key=api_key)
    except HTTPFailure as error:
        status = f" (HTTP {error.status})" if error.status is not None else ""
        message = f"{method} {base_url}{route} failed{status}: {error.message}"
        hint = _hint(route.split("?")[0], error, backend, sent_key=api_key is not None)
        raise WeightSyncError(f"{message}\n{hint}" if hint else message) from None


def served_dtype(base_url: str, *, timeout_s: float, api_key: str | None = None) -> torch.dtype:
    """The dtype the server's model runs in, from ``GET /server_info?config_format=json`` (a dev-mode route:
    ``vllm_config.model_config.dtype``, e.g. ``"torch.bfloat16"``). The first call takes a second or two: the
    server collects its environment report once."""
    answer = request("GET", base_url, "/server_info?config_format=json", timeout_s=timeout_s, api_key=api_key)
    try:
        name = answer["vllm_config"]["model_config"]["dtype"]
        return dtype_from_name(str(name).removeprefix("torch."))
    except (KeyError, TypeError, ValueError):
        raise WeightSyncError(
            f"GET {base_url}/server_info did not say the served dtype (vllm_config.model_config.dtype): "
            f"{answer!r:.300}\nname it instead: VLLMWeightSync(dtype=torch.bfloat16), or dtype=None to send as trained"
        ) from None
