"""Helpers for tests and local runs: launching real vLLM servers on this machine."""

from fastdistill_testing.vllm_server import VLLMServer, VLLMServerError

__all__ = ["VLLMServer", "VLLMServerError"]
