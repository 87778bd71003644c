"""vLLM plugin entry point (``vllm.general_plugins``): registers fastdistill's ``gloo`` weight-transfer engine."""


def register() -> None:
    """Register the engine with vLLM's factory (placeholder until the engine lands)."""
