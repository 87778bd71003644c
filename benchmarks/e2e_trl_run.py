"""One run of TRL 1.16's ``AsyncDistillationTrainer`` against running vLLM servers (a helper of bench_e2e.py).

``python benchmarks/e2e_trl_run.py spec.json``: the spec holds ``student_dir``, ``prompts`` (chat prompts), the server
URLs, ``output_dir`` and the shared settings. TRL runs with four shims (numbered in the code
below): no peak-FLOPs probe on CPU, SDPA attention, an injected gloo weight transfer (here
built on fastdistill's own transport; TRL's is NCCL-only), and TRL's "is vLLM installed" guard answered yes (its
worker only speaks HTTP; vLLM lives in its own venv here). Writes ``<output_dir>/trl_result.json`` with the trained
tokens, the stale-dropped samples, the wall time of ``train()``, the time from the last logged step to its end, and the
timestamps of bench_e2e's clock on the wall clock (``time.time()``): ``first_step_start`` (TRL's train-begin
callbacks done: cold weight sync, rollout worker started) and per step its end (``step_ends``, when its record is
logged, after its optimizer step and weight sync) and trained tokens (``step_tokens``). With ``snapshot_every`` > 0
in the spec, the student is saved by ``e2e_quality.Snapshotter`` (as bench_e2e's fastdistill runs save theirs) right
after each logged step's record, into ``<output_dir>/snapshots``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


class GlooWeightTransfer:
    """TRL's ``WeightTransferProtocol`` over fastdistill's gloo engine (pause/resume happen inside ``push``)."""

    def __init__(self, url: str):
        from fastdistill.sync import NamedTensors, VLLMWeightSync

        self.named_tensors = NamedTensors

        self.sync = VLLMWeightSync(url, backend="gloo")
        self.version = 0

    def init_weight_transfer(self) -> None:
        self.sync.init()

    def pause(self) -> None:
        pass

    def send_weights(self, iterator) -> None:
        self.version += 1
        self.sync.push(self.named_tensors([(name, tensor.detach()) for name, tensor in iterator]), self.version)

    def resume(self) -> None:
        pass

    def destroy(self) -> None:
        self.sync.close()


def main(spec_path: str) -> None:
    import torch
    import trl.experimental.async_distillation.async_distillation_trainer as trl_trainer
    import trl.experimental.async_distillation.async_rollout_worker as trl_worker
    from datasets import Dataset
    from e2e_quality import Snapshotter
    from transformers import TrainerCallback
    from trl.experimental.async_distillation import AsyncDistillationConfig, AsyncDistillationTrainer

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(1)
    trl_trainer.get_peak_flops_per_device = lambda *args, **kwargs: None  # shim 1: no CUDA device name on CPU
    # shim 4: TRL's worker refuses to start unless vLLM is importable, though it only speaks HTTP; vLLM lives in its
    # own venv here (the anchor run had TRL inside the vLLM venv instead)
    trl_worker.is_vllm_available = lambda *args, **kwargs: True
    output_dir = Path(spec["output_dir"])
    config = AsyncDistillationConfig(
        output_dir=str(output_dir), per_device_train_batch_size=spec["batch_size"], gradient_accumulation_steps=1,
        max_completion_length=spec["max_completion_length"], teacher_top_k=spec["top_k"], beta=0.0,
        learning_rate=spec["learning_rate"], bf16=False, fp16=False, dtype="float32", max_steps=spec["steps"],
        weight_sync_steps=1, logging_steps=1, report_to="none", save_strategy="no", token_budget=-1,
        vllm_server_base_url=spec["student_url"], teacher_server_urls={"default": spec["teacher_url"]},
        model_init_kwargs={"attn_implementation": "sdpa"},  # shim 2: no flash-attn hub kernel on CPU
        seed=spec["seed"], disable_tqdm=True,
    )
    records: list[dict] = []
    last_log = [time.perf_counter()]
    first_step_start = [None]
    every = spec.get("snapshot_every", 0)
    snapshot = Snapshotter(output_dir / "snapshots", every, spec["steps"]) if every > 0 else None

    class Record(TrainerCallback):
        """Added after TRL's own callbacks, so its train-begin runs after TRL's cold sync and worker start, and a
        step's record is logged after the step's weight-sync callback."""

        def on_train_begin(self, args, state, control, **kwargs):
            first_step_start[0] = time.time()

        def on_log(self, args, state, control, logs=None, **kwargs):
            records.append({**(logs or {}), "_time": time.time()})
            last_log[0] = time.perf_counter()
            if snapshot is not None and (logs or {}).get("batch/trained_tokens_per_step") is not None:
                snapshot(state.global_step, kwargs["model"])

    dataset = Dataset.from_list([{"prompt": prompt} for prompt in spec["prompts"]])
    trainer = AsyncDistillationTrainer(
        spec["student_dir"], args=config, train_dataset=dataset,
        weight_transfer=GlooWeightTransfer(spec["student_url"]),  # shim 3: gloo instead of NCCL
    )
    trainer.add_callback(Record())  # after the trainer's own callbacks (see Record)
    started = time.perf_counter()
    trainer.train()
    ended = time.perf_counter()
    trainer.save_model(str(output_dir / "final"))
    steps = [r for r in records if r.get("batch/trained_tokens_per_step") is not None]
    if first_step_start[0] is None or not steps:
        raise RuntimeError(f"no clock: train-begin at {first_step_start[0]}, {len(steps)} step records")
    result = {
        "wall_seconds": ended - started,
        "shutdown_s": ended - last_log[0],
        "steps": len(steps),
        "trained_tokens": sum(r["batch/trained_tokens_per_step"] for r in steps),
        "trained_samples": sum(r.get("batch/samples_per_step", 0.0) for r in steps),
        "dropped_stale_total": sum(r.get("sample/dropped_stale_total", 0.0) or 0.0 for r in records),
        "jsd_first": steps[0].get("jsd") if steps else None,
        "jsd_last": steps[-1].get("jsd") if steps else None,
        "first_step_start": first_step_start[0],
        "step_ends": [r["_time"] for r in steps],
        "step_tokens": [r["batch/trained_tokens_per_step"] for r in steps],
        "step_samples": [r.get("batch/samples_per_step", 0.0) for r in steps],
        # cumulative generated samples at each step's end: trained so far + dropped as stale so far
        "step_generated_samples": _generated(records),
    }
    (output_dir / "trl_result.json").write_text(json.dumps(result, indent=1))
    (output_dir / "trl_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def _generated(records: list[dict]) -> list[float]:
    """Per step record, the samples generated by then: trained so far plus the stale drops so far (each record's
    ``sample/dropped_stale_total`` is the drops since the previous record: TRL sums a ``_total`` over the window)."""
    out, trained, dropped = [], 0.0, 0.0
    for record in records:
        dropped += record.get("sample/dropped_stale_total", 0.0) or 0.0
        if record.get("batch/trained_tokens_per_step") is not None:
            trained += record.get("batch/samples_per_step", 0.0)
            out.append(trained + dropped)
    return out


if __name__ == "__main__":
    main(sys.argv[1])
