"""The teacher client's public full-distribution request (``TeacherClient.prompt_logprobs``), which the sampled cache
mode builds on instead of the client's private members (stub server, no model)."""

from __future__ import annotations

import ast
import asyncio
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_rollout_worker import FAST_RETRY, StubServer  # noqa: E402

from fastdistill.cache.sampled import FULL_VOCABULARY, check_full_distribution, score_full  # noqa: E402
from fastdistill.errors import ConfigError, VLLMRequestError  # noqa: E402
from fastdistill.rollout import TeacherClient  # noqa: E402

VOCAB = 4
SAMPLED = Path(__file__).resolve().parent.parent / "fastdistill" / "cache" / "sampled.py"


def full_teacher(requests: list, refuse: bool = False):
    """/v1/completions answering ``prompt_logprobs=-1`` with the whole 4-token distribution [0.1, 0.2, 0.3, 0.4] at
    every position but the first (None); ``refuse``: HTTP 400 about logprobs, as vLLM without --max-logprobs -1."""
    logprobs = np.log([0.1, 0.2, 0.3, 0.4])

    async def answer(body):
        requests.append(body)
        if refuse:
            return 400, {"error": {"message": "Requested prompt logprobs of -1, which is greater than max allowed: 20"}}
        entries = [None] + [{str(t): {"logprob": float(logprobs[t]), "rank": 4 - t} for t in range(VOCAB)}
                            for _ in body["prompt"][1:]]
        return 200, {"choices": [{"prompt_logprobs": entries}]}

    return answer


def test_prompt_logprobs_sends_the_request_and_returns_vllms_entries():
    requests: list = []
    with StubServer("teacher", full_teacher(requests)) as server:
        async def ask():
            async with TeacherClient(server.url, retry=FAST_RETRY) as client:
                return await client.prompt_logprobs([3, 1, 2], FULL_VOCABULARY)

        where, per_position = asyncio.run(ask())
    assert where == server.url + "/v1/completions"
    assert requests == [{"model": "teacher", "prompt": [3, 1, 2], "max_tokens": 1, "temperature": 1.0,
                         "prompt_logprobs": -1}]
    assert per_position[0] is None and len(per_position) == 3
    assert per_position[1]["3"] == {"logprob": pytest.approx(np.log(0.4)), "rank": 1}


def test_the_sampled_mode_scores_through_it_and_names_the_refusing_server():
    """score_full reads the dense distribution at the completion positions; a server that refuses the whole
    vocabulary is a ConfigError naming that server and the flag."""
    with StubServer("teacher", full_teacher([])) as good, StubServer("teacher", full_teacher([], refuse=True)) as bad:
        async def run():
            async with TeacherClient(good.url, retry=FAST_RETRY) as client:
                dense = await score_full(client, [3], [1, 2], VOCAB)
            async with TeacherClient(bad.url, retry=FAST_RETRY) as client:
                with pytest.raises(VLLMRequestError):
                    await score_full(client, [3], [1, 2], VOCAB)
                with pytest.raises(ConfigError, match=rf"teacher server \({bad.url}/v1/completions\) refuses "
                                                      r"full-vocabulary prompt_logprobs.*--max-logprobs -1"):
                    await check_full_distribution(client, [3, 1], VOCAB)
            return dense

        dense = asyncio.run(run())
    np.testing.assert_allclose(dense, np.log([[0.1, 0.2, 0.3, 0.4]] * 2).astype(np.float32), rtol=1e-6)


def test_the_sampled_mode_uses_no_private_member_of_the_rollout_client():
    """No ``client._...`` attribute and no private name imported from the rollout package."""
    tree = ast.parse(SAMPLED.read_text())
    private_attributes = [node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
                          and node.attr.startswith("_") and not node.attr.startswith("__")]
    private_imports = [alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                       and (node.module or "").startswith("fastdistill.rollout")
                       for alias in node.names if alias.name.startswith("_")]
    assert private_attributes == [] and private_imports == []
