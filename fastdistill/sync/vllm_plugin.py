"""vLLM plugin entry point (``vllm.general_plugins``): registers fastdistill's ``gloo`` weight-transfer engine and
installs the teacher-scoring plugin (:mod:`fastdistill.sync.vllm_scoring`).

vLLM calls :func:`register` once in each of its processes (API server, engine core, workers). Registration is by
module path, so the engine module (and the transport) is imported only in the worker that builds the engine.
"""

from __future__ import annotations

from fastdistill.sync.vllm_scoring import install

ENGINE_NAME = "gloo"
ENGINE_MODULE = "fastdistill.sync.vllm_engine"
ENGINE_CLASS = "GlooWeightTransferEngine"


def register() -> None:
    """Install the scoring plugin (query-id log-probs on ``/v1/completions``) and register engine ``"gloo"`` with
    vLLM's ``WeightTransferEngineFactory``; idempotent.

    Does nothing if vLLM has no weight-transfer factory (an older vLLM) or a ``gloo`` engine is already registered
    (the factory raises on duplicates; vLLM may one day ship its own).
    """
    install()
    try:  # an older vLLM has no weight-transfer factory
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:
        return
    if ENGINE_NAME in WeightTransferEngineFactory._registry:
        return
    WeightTransferEngineFactory.register_engine(ENGINE_NAME, ENGINE_MODULE, ENGINE_CLASS)
