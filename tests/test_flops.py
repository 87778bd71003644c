"""The step's useful FLOPs (fastdistill/train/flops.py), counted by hand on a tiny Qwen3, and the MFU metrics."""

from __future__ import annotations

import pytest
import torch

from fastdistill.tiny import build_model, tiny_config
from fastdistill.train.flops import (
    ATTENTION_PAIRS,
    MFU_FWD_BWD,
    MFU_WALL_CLOCK,
    StepMfu,
    causal_pairs,
    mfu_record,
    peak_flops,
    step_flops_model,
)

# hidden 16, 2 layers, 2 query heads and 1 key-value head of head_dim 8, intermediate 24, vocabulary 50, untied head
CONFIG = dict(hidden_size=16, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8, intermediate_size=24)
LENGTHS = [3, 5]  # two samples packed into one row of 8 tokens
TRAINED = 4  # completion positions the loss projects


def tiny():
    return build_model(tiny_config(50, **CONFIG))


def test_causal_pairs_are_per_sample():
    assert causal_pairs([3, 5]) == 6 + 15  # 3·4/2 + 5·6/2: no pair crosses a sample boundary
    assert causal_pairs([]) == 0 and causal_pairs([1]) == 1
    with pytest.raises(ValueError, match="length must be >= 0"):
        causal_pairs([2, -1])


def test_full_fine_tuning_counted_by_hand():
    # Forward FLOPs per token and layer, 2·in·out per linear layer:
    #   q 16→16: 512, k 16→8: 256, v 16→8: 256, o 16→16: 512, gate 16→24: 768, up 16→24: 768, down 24→16: 768
    #   = 3,840; two layers: 7,680.  lm_head: 2·16·50 = 1,600 per trained position.
    #   attention: 4·heads·head_dim·layers = 4·2·8·2 = 128 per causal pair.
    # Step (8 forwarded tokens, 4 trained positions, 6 + 15 = 21 pairs), everything trainable (3× the forward):
    #   linear 8·3·7,680 = 184,320; head 4·3·1,600 = 19,200; attention 3·21·128 = 8,064; total 211,584.
    model = step_flops_model(tiny())
    assert (model.trainable_per_token, model.frozen_per_token) == (7_680, 0)
    assert (model.head_per_position, model.head_trainable, model.attention_per_pair) == (1_600, True, 128)
    flops = model.step(forwarded_tokens=8, trained_tokens=TRAINED, attention_pairs=causal_pairs(LENGTHS))
    assert (flops.linear, flops.head, flops.attention) == (184_320, 19_200, 8_064)
    assert flops.total == 211_584


def test_lora_counts_frozen_weights_twice_the_forward_counted_by_hand():
    pytest.importorskip("peft")
    from fastdistill.train.lora import apply_lora

    lora = apply_lora(tiny(), r=2, alpha=4.0, dropout=0.0, target_modules=["q_proj", "v_proj"])
    # Adapters per layer (trainable): q: A 16→2 = 64, B 2→16 = 64; v: A 16→2 = 64, B 2→8 = 32: 224; two layers 448.
    # Base weights (frozen, no weight gradient): 7,680 as above; the lm_head is frozen too.
    # Step: linear 8·(3·448 + 2·7,680) = 133,632; head 4·2·1,600 = 12,800; attention 3·21·128 = 8,064.
    model = step_flops_model(lora)
    assert (model.trainable_per_token, model.frozen_per_token, model.head_trainable) == (448, 7_680, False)
    flops = model.step(8, TRAINED, causal_pairs(LENGTHS))
    assert (flops.linear, flops.head, flops.attention) == (133_632, 12_800, 8_064)
    assert flops.total == 154_496


def test_the_head_counts_trained_positions_only_and_attention_the_packed_lengths():
    model = step_flops_model(tiny())
    one_sample = model.step(8, 8, causal_pairs([8]))
    packed = model.step(8, 2, causal_pairs([4, 4]))
    assert one_sample.head == 4 * packed.head  # 8 positions projected against 2
    assert one_sample.attention / packed.attention == pytest.approx(36 / 20)  # 8·9/2 against 2·(4·5/2)
    with pytest.raises(ValueError, match=">= 0"):
        model.step(8, -1, 0)


def test_mfu_metrics_say_they_divide_by_the_datasheet_rate():
    model = step_flops_model(tiny())
    record = {"batch/forwarded_tokens_per_step": 8.0, "batch/trained_tokens_per_step": float(TRAINED),
              ATTENTION_PAIRS: 21.0, "perf/fwd_bwd_s": 2.0, "perf/step_s": 4.0}
    out = mfu_record(record, model, peak=1_000.0, world_size=2)  # 211,584 FLOPs over 2 devices of 1,000 FLOP/s
    assert out[MFU_FWD_BWD] == pytest.approx(100 * 211_584 / 2.0 / 2_000)
    assert out[MFU_WALL_CLOCK] == pytest.approx(100 * 211_584 / 4.0 / 2_000)
    assert out["perf/step_tflop"] == pytest.approx(211_584 / 1e12)
    assert MFU_FWD_BWD.endswith("_datasheet") and MFU_WALL_CLOCK.endswith("_datasheet")
    assert mfu_record(record, model, peak=None, world_size=1) == {}  # CPU: no MFU rather than a made-up one
    assert mfu_record({k: v for k, v in record.items() if k != ATTENTION_PAIRS}, model, 1_000.0, 1) == {}
    assert peak_flops(torch.device("cpu"), torch.bfloat16) is None



def test_the_run_s_mfu_counts_every_rank_s_samples_of_the_window():
    from types import SimpleNamespace

    sample = lambda n: SimpleNamespace(input_ids=[0] * n)  # noqa: E731
    # two micro-batches of two ranks: rank 1's row of the second micro-batch is empty (a ghost row)
    window = SimpleNamespace(microbatches=[[[sample(3)], [sample(5)]], [[sample(2), sample(1)], []]])
    record = {"batch/forwarded_tokens_per_step": 11.0, "batch/trained_tokens_per_step": 4.0, "perf/fwd_bwd_s": 1.0,
              "perf/step_s": 2.0}
    mfu = StepMfu(tiny(), peak=1e6, world_size=2)
    out = mfu.record(record, window)
    assert out[ATTENTION_PAIRS] == 6 + 15 + 3 + 1
    flops = mfu.flops_model.step(11, 4, 25).total
    assert out[MFU_FWD_BWD] == pytest.approx(100 * flops / 1.0 / 2e6)
    assert mfu.record(record, None) == {}  # ranks other than 0: no window, no metrics
    assert StepMfu(tiny(), peak=None, world_size=1).record(record, window) == {ATTENTION_PAIRS: 25.0}  # a CPU


# ------------------------------------------------------------------------------------------------ not dense

# A tiny Qwen3-MoE: hidden 16, 2 layers, 2 query heads and 1 key-value head of head_dim 8, vocabulary 50; layer 0 a
# mixture of 4 experts of intermediate 8, each token routed to 2 of them; layer 1 a dense MLP of intermediate 24.
MOE = dict(vocab_size=50, hidden_size=16, intermediate_size=24, moe_intermediate_size=8, num_hidden_layers=2,
           num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts=4, num_experts_per_tok=2,
           mlp_only_layers=[1])
# Forward FLOPs per token, 2·in·out per matmul:
#   attention projections, per layer: q 512 + k 256 + v 256 + o 512 = 1,536; two layers 3,072
#   layer 0: one expert is gate 16→8 (256) + up 16→8 (256) + down 8→16 (256) = 768; a token runs 2 of the 4:
#            1,536 (all four would be 3,072); the router 16→4: 128; together 1,664
#   layer 1: gate 16→24 (768) + up (768) + down 24→16 (768) = 2,304
#   total 3,072 + 1,664 + 2,304 = 7,040
MOE_PER_TOKEN = 7_040


def tiny_moe():
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(Qwen3MoeConfig(**MOE))


def test_moe_experts_count_at_their_top_k_per_token_counted_by_hand():
    model = step_flops_model(tiny_moe())
    assert (model.trainable_per_token, model.frozen_per_token) == (MOE_PER_TOKEN, 0)
    assert (model.head_per_position, model.attention_per_pair) == (2 * 16 * 50, 4 * 2 * 8 * 2)
    # a step of 8 forwarded tokens, 4 trained positions, 21 pairs: 8·3·7,040 + 4·3·1,600 + 3·21·128
    assert model.step(8, TRAINED, causal_pairs(LENGTHS)).total == 168_960 + 19_200 + 8_064


def test_moe_experts_as_a_list_of_linear_layers_count_the_same():
    """transformers 4's layout of the same block: the experts a ``ModuleList`` of MLPs of ``nn.Linear`` layers, the
    router an ``nn.Linear``: each expert's layers count at top_k / experts = 2 / 4, the router once."""
    from torch import nn
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeMLP

    moe = tiny_moe()
    block = moe.model.layers[0].mlp
    block.experts = nn.ModuleList(Qwen3MoeMLP(moe.config, intermediate_size=8) for _ in range(4))
    block.gate = nn.Linear(16, 4, bias=False)
    assert step_flops_model(moe).trainable_per_token == MOE_PER_TOKEN


def test_frozen_experts_count_twice_their_forward():
    moe = tiny_moe()
    for parameter in moe.model.layers[0].mlp.parameters():
        parameter.requires_grad_(False)
    model = step_flops_model(moe)
    assert (model.trainable_per_token, model.frozen_per_token) == (MOE_PER_TOKEN - 1_664, 1_664)


def test_sliding_window_pairs_counted_by_hand():
    # window 4: query i sees keys i-3..i (Hugging Face's kv_idx > q_idx - sliding_window)
    assert causal_pairs([6], window=4) == 1 + 2 + 3 + 4 + 4 + 4
    assert causal_pairs([3, 6], window=4) == 6 + 18 and causal_pairs([3, 6]) == 6 + 21
    assert causal_pairs([4], window=4) == causal_pairs([4]) == 10 and causal_pairs([5], window=1) == 5
    with pytest.raises(ValueError, match="window must be >= 1"):
        causal_pairs([3], window=0)


def sliding(kind: str):
    from transformers import AutoModelForCausalLM, MistralConfig, Qwen2Config

    shape = dict(vocab_size=50, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1)
    if kind == "qwen2":  # layer_types: layer 0 full, layer 1 a window of 4
        config = Qwen2Config(**shape, use_sliding_window=True, sliding_window=4, max_window_layers=1)
    elif kind == "qwen2-off":  # a window configured but not used
        config = Qwen2Config(**shape, use_sliding_window=False, sliding_window=4)
    else:  # Mistral: every layer a window of 4
        config = MistralConfig(**shape, head_dim=8, sliding_window=4)
    return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("kind, windows, attention", [
    # per layer 4·heads·head_dim = 64 forward FLOPs per pair; samples of 3 and 6 tokens: 27 pairs full, 24 in a
    # window of 4; forward + backward 3× the forward
    ("qwen2", (None, 4), 3 * 64 * (27 + 24)),
    ("mistral", (4, 4), 3 * 64 * (24 + 24)),
    ("qwen2-off", (), 3 * 64 * (27 + 27)),
])
def test_sliding_window_attention_counts_the_pairs_in_its_window(kind, windows, attention):
    model = step_flops_model(sliding(kind))
    assert model.layer_windows == windows and model.attention_per_pair == 64 * 2
    assert model.step(9, 2, model.attended_pairs([3, 6])).attention == attention


def test_the_run_s_mfu_counts_a_sliding_window_s_pairs_and_logs_the_causal_ones():
    from types import SimpleNamespace

    window = SimpleNamespace(microbatches=[[[SimpleNamespace(input_ids=[0] * 3), SimpleNamespace(input_ids=[0] * 6)]]])
    record = {"batch/forwarded_tokens_per_step": 9.0, "batch/trained_tokens_per_step": 2.0, "perf/fwd_bwd_s": 1.0,
              "perf/step_s": 1.0}
    mfu = StepMfu(sliding("qwen2"), peak=1e6, world_size=1)
    out = mfu.record(record, window)
    assert out[ATTENTION_PAIRS] == 27  # the metric stays the causal pairs of the samples
    model = mfu.flops_model
    expected = 9 * 3 * model.trainable_per_token + 2 * 3 * model.head_per_position + 3 * 64 * (27 + 24)
    assert out["perf/step_tflop"] == pytest.approx(expected / 1e12)


@pytest.mark.slow
def test_two_gloo_ranks_log_every_rank_s_causal_pairs(tmp_path_factory, tmp_path):
    """Two trainer ranks (torchrun, FSDP2 over gloo): rank 0's logged attention pairs and forwarded tokens cover both
    ranks' samples, so over an epoch they add up to Σ L·(L+1)/2 and Σ L of every sample trained."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from trainer_cases import TEACHERS, synthetic_run_samples, tiny_student_dir

    student = tiny_student_dir(tmp_path_factory)
    samples = synthetic_run_samples(8)
    spec = {"student_dir": str(student), "output_dir": str(tmp_path / "out"), "num_samples": 8, "seed": 3,
            "config": {"teacher_server_urls": TEACHERS, "weight_sync_backend": "none", "num_train_epochs": 1,
                       "per_device_train_batch_size": 2, "token_budget": 0, "gradient_checkpointing": False,
                       "disable_tqdm": True, "save_strategy": "no", "export_final_model": False}}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(Path(__file__).parent / "run_trainer.py"), str(tmp_path / "spec.json")],
                          capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines() if line]
    assert len(records) == 2  # 8 samples, 2 per rank and step
    lengths = [len(s.input_ids) for s in samples]
    assert sum(r[ATTENTION_PAIRS] for r in records) == causal_pairs(lengths)
    assert sum(r["batch/forwarded_tokens_per_step"] for r in records) == sum(lengths)
