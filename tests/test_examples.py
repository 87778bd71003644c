"""The example recipes' configs load and validate, and their launch scripts use real CLI commands."""

from __future__ import annotations

from pathlib import Path

import pytest

from fastdistill.cli import build_parser
from fastdistill.train import AsyncDistillationConfig

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
RECIPES = sorted(p.parent for p in EXAMPLES.glob("*/config.yaml"))


def test_there_are_recipes():
    assert {p.name for p in RECIPES} >= {"single-teacher", "mopd", "lora"}


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_recipe_config_is_valid(recipe):
    config = AsyncDistillationConfig.from_yaml(recipe / "config.yaml")
    assert config.teacher_ids and config.model_name_or_path


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_launch_script_commands_parse(recipe):
    parser = build_parser()
    for line in (recipe / "launch.sh").read_text().splitlines():
        words = line.split()
        if "fastdistill" in words:
            args = words[words.index("fastdistill") + 1 :]
        elif "fastdistill.cli" in words:
            args = words[words.index("fastdistill.cli") + 1 :]
        else:
            continue
        args = [a for a in args if a != "&"]
        if "--" in args:
            args = args[: args.index("--")]
        parsed = parser.parse_args(args)
        if parsed.command == "train":
            assert (recipe / parsed.config.name).is_file()
