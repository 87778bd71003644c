"""``vllm_server_base_url`` is one student server: anything else is a ConfigError naming the field at load time."""

from __future__ import annotations

import pytest

from fastdistill.errors import ConfigError
from fastdistill.train.config import AsyncDistillationConfig


@pytest.mark.parametrize("value", [["http://a:8000", "http://b:8000"], ["http://a:8000"], None, 8000, "localhost:8000"],
                         ids=["replicas", "one-in-a-list", "none", "int", "no-scheme"])
def test_anything_but_one_http_url_is_a_config_error(value):
    """Student replicas (a list, which RolloutConfig accepts for the rollouts) cannot be trained against: the weight
    sync and its check address one server. The error names the field and says so, from a YAML file's values too."""
    with pytest.raises(ConfigError, match=r"vllm_server_base_url must be an http\(s\) URL, one server \(a list of "
                                          r"student replicas is not supported: the weight sync updates one student "
                                          r"server\)"):
        AsyncDistillationConfig.from_dict({"model_name_or_path": "m", "vllm_server_base_url": value})


def test_one_url_loads():
    config = AsyncDistillationConfig.from_yaml(None, ["model_name_or_path=m", "vllm_server_base_url=https://s:1"])
    assert config.vllm_server_base_url == "https://s:1"
