"""LoRA weight sync streams merged weights: one merged tensor at a time, equal to peft's own merge."""

from __future__ import annotations

import copy
import inspect
import weakref

import pytest
import torch

pytest.importorskip("peft")

from fastdistill.sync import NamedTensors, iter_named_weights, snapshot_weights, weight_manifest  # noqa: E402
from fastdistill.sync.lora import merged_named_weights, merged_weight_manifest, merged_weights  # noqa: E402
from fastdistill.tiny import build_model, build_tokenizer, tiny_config  # noqa: E402
from fastdistill.train.lora import apply_lora  # noqa: E402


@pytest.fixture(scope="module")
def lora_model() -> torch.nn.Module:
    """A tiny Qwen3 with rank-4 adapters on every linear layer, B randomised so that the merge changes W."""
    tokenizer = build_tokenizer()
    model = build_model(tiny_config(len(tokenizer), pad_token_id=tokenizer.pad_token_id), seed=0).float()
    peft_model = apply_lora(model, r=4, alpha=8.0, dropout=0.0, target_modules="all-linear")
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))
    return peft_model.eval()


def peft_merge(peft_model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The oracle: peft's merge_and_unload on a copy."""
    return copy.deepcopy(peft_model).merge_and_unload().state_dict()


def test_merged_weights_equal_peft_merge_and_only_one_exists_at_a_time(lora_model):
    reference = peft_merge(lora_model)
    base = {name.replace(".base_layer", ""): tensor for name, tensor in lora_model.get_base_model().state_dict().items()
            if ".lora_" not in name}
    assert set(base) == set(reference)
    assert any(not torch.equal(reference[name], base[name]) for name in reference)  # the adapters change weights
    stream = merged_named_weights(lora_model)
    assert inspect.isgenerator(stream)  # nothing is merged before the consumer asks
    alive = peak = 0
    seen = []

    def released() -> None:
        nonlocal alive
        alive -= 1

    for name, tensor in stream:
        alive += 1
        peak = max(peak, alive)
        weakref.finalize(tensor, released)
        torch.testing.assert_close(tensor, reference[name], rtol=1e-6, atol=1e-7)
        seen.append(name)
        del tensor
    assert sorted(seen) == sorted(reference)
    assert peak == 1, f"{peak} yielded tensors were alive at once"


def test_merged_manifest_and_stream_feed_the_sync_path(lora_model):
    reference = peft_merge(lora_model)
    manifest = merged_weight_manifest(lora_model)
    assert [spec.name for spec in manifest] == [name for name, _ in merged_named_weights(lora_model)]
    assert all(spec.shape == tuple(reference[spec.name].shape) and spec.dtype == reference[spec.name].dtype
               for spec in manifest)
    streamed = merged_weights(lora_model)
    assert isinstance(streamed, NamedTensors)
    assert weight_manifest(streamed) == manifest
    assert {spec.dtype for spec in weight_manifest(streamed, dtype=torch.bfloat16)} == {torch.bfloat16}
    for _ in range(2):  # every pass merges afresh
        sent = dict(iter_named_weights(streamed, dtype=torch.bfloat16))
        assert set(sent) == set(reference)
        assert all(torch.equal(sent[name], reference[name].to(torch.bfloat16)) for name in sent)


def test_a_snapshot_of_the_stream_does_not_follow_later_training(lora_model):
    streamed = merged_weights(lora_model)
    snapshot = snapshot_weights(streamed)
    before = {name: tensor.clone() for name, tensor in snapshot}
    name, param = next((n, p) for n, p in lora_model.named_parameters() if "lora_B" in n)
    try:
        with torch.no_grad():
            param.add_(1.0)
        assert all(torch.equal(tensor, before[n]) for n, tensor in snapshot)
        assert any(not torch.equal(tensor, before[n]) for n, tensor in iter_named_weights(streamed))
    finally:
        with torch.no_grad():
            param.sub_(1.0)


def counting_stream(monkeypatch) -> dict[str, int]:
    """Make export_merged's merged stream count how many of its yielded tensors are alive at once."""
    import fastdistill.train.lora as lora

    counts = {"alive": 0, "peak": 0}
    real = lora.merged_named_weights

    def released() -> None:
        counts["alive"] -= 1

    def stream(model):
        for name, tensor in real(model):
            counts["alive"] += 1
            counts["peak"] = max(counts["peak"], counts["alive"])
            weakref.finalize(tensor, released)
            yield name, tensor
            del tensor

    monkeypatch.setattr(lora, "merged_named_weights", stream)
    return counts


def test_the_export_on_other_ranks_holds_one_merged_tensor_at_a_time(lora_model, tmp_path, monkeypatch):
    """Every rank takes part in the gathers, but only rank 0 keeps the tensors (on its CPU): the others drop each
    one as it comes instead of holding the whole merged model on their device."""
    from fastdistill.train.lora import export_merged

    counts = counting_stream(monkeypatch)
    assert export_merged(lora_model, None, tmp_path / "final", is_main=False) is None
    assert counts["peak"] == 1, f"{counts['peak']} merged tensors were alive at once on a non-main rank"
    assert not (tmp_path / "final").exists()


def test_the_export_on_rank_0_equals_the_merged_weights_on_the_cpu(lora_model, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    import fastdistill.train.lora as lora

    saved = {}
    real_save = type(lora_model.get_base_model()).save_pretrained

    def recording_save(model, path, state_dict, **kwargs):
        saved.update(state_dict)
        return real_save(model, path, state_dict=state_dict, **kwargs)

    monkeypatch.setattr(type(lora_model.get_base_model()), "save_pretrained", recording_save)
    tokenizer = build_tokenizer()
    assert lora.export_merged(lora_model, tokenizer, tmp_path / "final", is_main=True) == tmp_path / "final"
    assert {tensor.device.type for tensor in saved.values()} == {"cpu"}
    reference = peft_merge(lora_model)
    exported = load_file(tmp_path / "final" / "model.safetensors")
    assert set(exported) == set(reference)
    for name, tensor in exported.items():
        torch.testing.assert_close(tensor, reference[name], rtol=1e-6, atol=1e-7)
    assert (tmp_path / "final" / "tokenizer_config.json").is_file()
