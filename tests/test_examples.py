"""The example recipes' configs load and validate, and their launch scripts use real CLI commands."""

from __future__ import annotations

from pathlib import Path

import pytest

from fastdistill.cli import build_parser
from fastdistill.train import AsyncDistillationConfig

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
RECIPES = sorted(p.parent for p in EXAMPLES.glob("*/config.yaml"))


def test_there_are_recipes():
    assert {p.name for p in RECIPES} >= {"single-teacher", "mopd", "lora", "hidden-teacher"}


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


def test_the_multinode_example_is_what_fastdistill_launch_reads():
    """examples/multinode: cluster.yaml loads as a launcher config, its train config with the URLs the launcher adds
    is a valid trainer config, and the README's commands parse."""
    from fastdistill.launch import Cluster

    cluster = Cluster.from_yaml(EXAMPLES / "multinode" / "cluster.yaml")
    assert cluster.train_config == (EXAMPLES / "multinode" / "train.yaml").resolve()
    config = AsyncDistillationConfig.from_yaml(cluster.train_config, cluster.server_overrides())
    assert config.vllm_server_base_url == cluster.student.url and config.teacher_ids == ["default"]
    commands = [line.split("#")[0].split() for line in (EXAMPLES / "multinode" / "README.md").read_text().splitlines()
                if line.startswith("fastdistill launch")]
    assert len(commands) == 2
    for words in commands:
        parsed = build_parser().parse_args(words[1:])
        assert parsed.command == "launch" and parsed.cluster.name == "cluster.yaml"


# ------------------------------------------------------------------------------------------------ they train


@pytest.fixture(scope="module")
def tiny_student(tmp_path_factory):
    from fastdistill.tiny import build_model, build_tokenizer, save_pretrained_dir, tiny_config

    tokenizer = build_tokenizer()
    model = build_model(tiny_config(len(tokenizer), pad_token_id=0, eos_token_id=2), seed=7)
    return save_pretrained_dir(model, tokenizer, tmp_path_factory.mktemp("student"))


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_one_step_of_a_recipe_changes_the_weights_it_trains(recipe, tiny_student, tmp_path):
    """Each recipe's own settings (dtype, bf16, learning rate, LoRA, schedule) on a tiny model: after one optimizer
    step most trained weights have moved. bfloat16 master weights at lr 1e-6 would stay put (the update is far below
    half a bfloat16 ulp), which is what the full fine-tuning recipes used to do."""
    import sys

    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    from run_trainer import teacher_and_samples

    from fastdistill.train import AsyncDistillationTrainer

    recipe_config = AsyncDistillationConfig.from_yaml(recipe / "config.yaml")
    values = {**recipe_config.to_dict(), "model_name_or_path": str(tiny_student), "output_dir": str(tmp_path),
              "train_dataset": None, "report_to": [], "weight_sync_backend": "none", "max_steps": 1,
              "save_strategy": "no", "export_final_model": False, "disable_tqdm": True, "token_budget": 0,
              "max_completion_length": 16, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 1,
              "warmup_ratio": 0.0, "eval_dataset": None}
    if recipe_config.hidden_teacher_ids:  # the tiny model's own head and hidden states stand in for the teacher's
        values["teacher_model_paths"] = {t: str(tiny_student) for t in recipe_config.hidden_teacher_ids}
    config = AsyncDistillationConfig(**values)
    samples = teacher_and_samples(4, seed=3, teacher_ids=config.teacher_ids)
    samples = [as_hidden(s, tiny_student) if s.teacher_id in config.hidden_teacher_ids else s for s in samples]
    trainer = AsyncDistillationTrainer(config, samples=samples)
    assert trainer.master_weights_warning is None
    trained = {n: p for n, p in trainer.hf_model.named_parameters() if p.requires_grad}
    before = {n: p.detach().clone() for n, p in trained.items()}
    trainer.train()
    if config.lora_r > 0:  # B starts at zero: the adapters' B matrices are what must move
        trained = {n: p for n, p in trained.items() if "lora_B" in n}
    moved = sum(int((p.detach() != before[n]).sum()) for n, p in trained.items())
    total = sum(p.numel() for p in trained.values())
    assert moved / total > 0.5, f"only {moved} of {total} trained weights changed"
    assert all(p.dtype == torch.float32 for p in trained.values())


def as_hidden(sample, model_dir):
    """``sample`` scored by a hidden-state teacher (the model in ``model_dir``): its bfloat16 final hidden states
    at the completion's positions instead of top-K candidates."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from fastdistill.rollout.client import Generation
    from fastdistill.rollout.hidden import TeacherHiddenStates
    from fastdistill.rollout.sample import RolloutSample

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt = sample.input_ids[: sample.prompt_length].tolist()
    completion = sample.completion_ids.tolist()
    with torch.no_grad():
        hidden = model.model(torch.tensor([prompt + completion])).last_hidden_state[0]
    rows = hidden[len(prompt) - 1 : len(prompt) + len(completion) - 1].bfloat16()
    return RolloutSample.assemble(prompt, Generation(np.asarray(completion, np.int32), sample.rollout_logprobs),
                                  TeacherHiddenStates(rows), model_version=0, teacher_id=sample.teacher_id,
                                  prompt_id=sample.prompt_id, dataset_index=sample.dataset_index)


def test_bfloat16_master_weights_with_full_fine_tuning_warn(tiny_student, tmp_path, caplog):
    from fastdistill.train import AsyncDistillationTrainer

    config = AsyncDistillationConfig(model_name_or_path=str(tiny_student), output_dir=str(tmp_path),
                                     dtype="bfloat16", weight_sync_backend="none", disable_tqdm=True)
    with caplog.at_level("WARNING", logger="fastdistill"):
        trainer = AsyncDistillationTrainer(config, samples=[])
    assert str(trainer.master_weights_warning) == "torch.bfloat16"
    assert "Full fine-tuning with bfloat16 master weights (dtype='bfloat16')" in caplog.text
    assert "most weights will never change" in caplog.text
    lora = AsyncDistillationConfig(model_name_or_path=str(tiny_student), output_dir=str(tmp_path / "lora"),
                                   dtype="bfloat16", lora_r=4, weight_sync_backend="none", disable_tqdm=True)
    assert AsyncDistillationTrainer(lora, samples=[]).master_weights_warning is None
