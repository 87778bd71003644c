"""What a weight sync does to a generation in flight on the installed vLLM: ``weight_versions`` and ``clear_cache``.

Starts one tiny student vLLM server (vLLM from ``$FASTDISTILL_VLLM_PYTHON``; gloo weight transfer, the scale-out
``/inference/v1/generate`` route, KV blocks of 32 tokens) serving weights A, and for each way of syncing:

- ``keep+clear``: ``/pause?mode=keep&clear_cache=true`` (vLLM's default) → update → ``/resume``, the sequence
  :class:`~fastdistill.sync.VLLMWeightSync` runs with ``one_call=False``;
- ``keep+noclear``: the same with ``/pause?mode=keep&clear_cache=false``;
- ``one-call``: what ``one_call=True`` (the default on CPU) runs: one ``/collective_rpc`` between two engine steps,
  no pause, then ``/reset_prefix_cache?reset_running_requests=true`` and ``/update_weight_version``;

it streams a 1024-token sampled generation, pushes weights B once 48 tokens have arrived, and reads the rest with its
``weight_versions`` spans (a mode whose push landed only after the generation ended, on a machine so loaded that the
push's calls took longer than ~970 tokens, is run again on a fresh prompt, up to :data:`ATTEMPTS` times; the
report counts the attempts). Each output token's served log-prob is compared with three float32 Hugging Face oracles:
A on the whole sequence, B on the whole sequence, and "mixed" (the KV cache of A up to the token where B took over,
B from there: what an engine that keeps the in-flight request's old KV computes). Then a new request whose prompt
is the first request's prompt plus 64 of its tokens checks whether the prefix cache still serves KV of A after the
sync (the served log-prob of its first sampled token against B's).

    python benchmarks/probe_keep_mode.py                    # table + benchmarks/results/keep_mode_probe.json
    python benchmarks/probe_keep_mode.py --json /tmp/probe.json --modes one-call
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from fastdistill.serve import VLLMServer
from fastdistill.sync import VLLMWeightSync
from fastdistill.tiny import build_model, build_tokenizer, save_pretrained_dir, tiny_config

MODES = ("keep+clear", "keep+noclear", "one-call")
BLOCK = 32  # KV block size: the prompt spans whole blocks, so the prefix cache can hold them
PROMPT_TOKENS = 64
MAX_TOKENS = 1024  # the tokens after the push's start: under load the push lands ~250 tokens after it starts
SWITCH_AFTER = 48  # tokens streamed before the push of B starts
ATTEMPTS = 3
MATCH_NATS = 1e-4  # two float32 computations of the same log-prob agree far closer than this
SEEDS = {"A": 1, "B": 5}


class _NoClearSync(VLLMWeightSync):
    """``/pause?mode=keep&clear_cache=false`` instead of vLLM's default ``clear_cache=true`` while ``clear`` is
    False."""

    clear = True

    def _call(self, method: str, route: str, payload: Any = None, *, timeout_s: float | None = None) -> Any:
        if route.startswith("/pause?mode=keep") and not self.clear:
            route = "/pause?mode=keep&clear_cache=false"
        return super()._call(method, route, payload, timeout_s=timeout_s)


def _post(url: str, payload: dict[str, Any], timeout_s: float = 300.0) -> Any:
    request = urllib.request.Request(url, json.dumps(payload).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read())


def stream_generation(base_url: str, prompt: list[int], *, on_tokens: Any, seed: int) -> dict[str, Any]:
    """Stream ``/inference/v1/generate``; ``on_tokens(count)`` runs after every chunk. Returns the token ids, their
    served log-probs and the final chunk's ``weight_versions``."""
    payload = {"token_ids": prompt, "stream": True,
               "sampling_params": {"max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": seed, "ignore_eos": True,
                                   "logprobs": 0}}
    request = urllib.request.Request(f"{base_url}/inference/v1/generate", json.dumps(payload).encode(),
                                     {"Content-Type": "application/json"})
    tokens: list[int] = []
    logprobs: list[float] = []
    spans = None
    with urllib.request.urlopen(request, timeout=600) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            choice = json.loads(line[5:])["choices"][0]
            tokens += choice.get("token_ids") or []
            logprobs += [entry["logprob"] for entry in ((choice.get("logprobs") or {}).get("content") or [])]
            if choice.get("weight_versions") is not None:
                spans = choice["weight_versions"]
            on_tokens(len(tokens))
    return {"token_ids": tokens, "logprobs": logprobs, "weight_versions": spans}


@torch.no_grad()
def oracle_logprobs(model: Any, sequence: list[int], prompt_length: int) -> torch.Tensor:
    """log p(token) of every output token of ``sequence`` under ``model`` (float32, one forward)."""
    ids = torch.tensor([sequence])
    logits = model(ids, use_cache=False).logits[0].float()
    picked = torch.log_softmax(logits, -1)[prompt_length - 1 : -1]
    return picked.gather(1, ids[0, prompt_length:, None]).squeeze(1)


@torch.no_grad()
def mixed_oracle(model_a: Any, model_b: Any, sequence: list[int], prompt_length: int, switch: int) -> torch.Tensor:
    """The output tokens' log-probs when A computed the KV of every position before output token ``switch`` and B
    every later one (the old KV kept across the sync)."""
    cut = prompt_length + switch - 1  # the position whose logits give output token ``switch``: B computes it
    ids = torch.tensor([sequence])
    head = model_a(ids[:, :cut], use_cache=True)
    before = torch.log_softmax(head.logits[0].float(), -1)[prompt_length - 1 :]
    tail = model_b(ids[:, cut:], past_key_values=head.past_key_values, use_cache=True)
    after = torch.log_softmax(tail.logits[0, :-1].float(), -1)
    picked = torch.cat([before, after])
    return picked.gather(1, ids[0, prompt_length:, None]).squeeze(1)


def first_departure(served: torch.Tensor, reference: torch.Tensor) -> int | None:
    """The first index where ``served`` leaves ``reference`` by more than :data:`MATCH_NATS`."""
    off = ((served - reference).abs() > MATCH_NATS).nonzero()
    return int(off[0]) if off.numel() else None


def run_mode(mode: str, server: VLLMServer, models: dict[str, Any], prompt: list[int], versions: dict[str, int],
             seed: int) -> dict[str, Any]:
    """One generation across a sync of A → B in ``mode``, its spans against the oracles, and the prefix-cache
    request after it."""
    sync = _NoClearSync(server.url, timeout_s=120)
    sync.init()
    try:
        # A goes in by the paused path that clears the caches: every mode starts from A with nothing cached
        sync.one_call, sync.clear = False, True
        sync.push(models["A"], versions["A"])
        sync.one_call, sync.clear = mode == "one-call", mode != "keep+noclear"
        pushed: dict[str, float] = {}

        def on_tokens(count: int) -> None:
            if count >= SWITCH_AFTER and not pushed:
                started = time.perf_counter()
                sync.push(models["B"], versions["B"])
                pushed["at_token"] = count
                pushed["push_s"] = time.perf_counter() - started

        out = stream_generation(server.url, prompt, on_tokens=on_tokens, seed=seed)
    finally:
        sync.close()
    tokens, served = out["token_ids"], torch.tensor(out["logprobs"], dtype=torch.float32)
    sequence = prompt + tokens
    under_a = oracle_logprobs(models["A"], sequence, len(prompt))
    under_b = oracle_logprobs(models["B"], sequence, len(prompt))
    spans = out["weight_versions"]
    # the token where B took over: where the served log-probs leave A's (B's weights differ everywhere)
    switch = first_departure(served, under_a)
    label_b = str(versions["B"])
    labelled_switch = next((span["start"] for span in spans or [] if span["version"] == label_b), None)
    result: dict[str, Any] = {
        "mode": mode, "tokens": len(tokens), "push_started_after_tokens": pushed.get("at_token"),
        "push_s": pushed.get("push_s"), "weight_versions": spans, "labelled_switch": labelled_switch,
        "switch": switch,
    }
    if switch is None or switch == 0:
        result["finding"] = "the push did not land inside the generation"
        return result
    mixed = mixed_oracle(models["A"], models["B"], sequence, len(prompt), switch)
    after = slice(switch, None)
    off_b = ((served[after] - under_b[after]).abs() > MATCH_NATS).nonzero()
    result.update({
        # tokens after the switch before the served log-probs settle on B's for good (generated by B's weights on
        # KV that is not all B's)
        "tokens_before_settling_on_B": int(off_b[-1]) + 1 if off_b.numel() else 0,
        "before_switch_max_abs_vs_A": float((served[:switch] - under_a[:switch]).abs().max()),
        "after_switch_max_abs_vs_B": float((served[after] - under_b[after]).abs().max()),
        "after_switch_max_abs_vs_mixed": float((served[after] - mixed[after]).abs().max()),
    })
    unsettled = result["tokens_before_settling_on_B"]
    if result["after_switch_max_abs_vs_mixed"] <= MATCH_NATS:
        result["prefix_kv"] = "kept from A"
    elif switch + unsettled < len(tokens):
        result["prefix_kv"] = "recomputed under B" + (f" after {unsettled} tokens" if unsettled else "")
    else:
        result["prefix_kv"] = "neither oracle"
    result["labels_exact"] = labelled_switch == switch
    result["prefix_cache"] = prefix_cache_after(server, models, prompt + tokens[:64], seed)
    return result


def prefix_cache_after(server: VLLMServer, models: dict[str, Any], prompt: list[int], seed: int) -> dict[str, Any]:
    """A new request, after the sync, whose prompt (the earlier request's prompt and first 64 tokens: 4 whole KV
    blocks of tokens the earlier request computed) the prefix cache may still hold: its first sampled token's
    served log-prob against B's and A's."""
    payload = {"token_ids": prompt, "sampling_params": {"max_tokens": 1, "temperature": 1.0, "seed": seed,
                                                        "logprobs": 0}}
    choice = _post(f"{server.url}/inference/v1/generate", payload)["choices"][0]
    token, served = choice["token_ids"][0], choice["logprobs"]["content"][0]["logprob"]
    gaps = {name: abs(served - float(oracle_logprobs(models[name], prompt + [token], len(prompt))[0]))
            for name in ("A", "B")}
    return {"prompt_tokens": len(prompt), "gap_vs_B": gaps["B"], "gap_vs_A": gaps["A"],
            "serves": "B" if gaps["B"] <= MATCH_NATS else "stale KV (not B)"}


def probe(modes: list[str], work: Path, *, seed: int = 0) -> dict[str, Any]:
    """Start the server in ``work``, run each mode, stop the server; the report."""
    tokenizer = build_tokenizer()
    config = tiny_config(len(tokenizer), pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         max_position_embeddings=PROMPT_TOKENS + MAX_TOKENS + 128)
    models = {name: build_model(config, seed=s).float().eval() for name, s in SEEDS.items()}
    folder = save_pretrained_dir(models["A"], tokenizer, work / "student")
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, config.vocab_size, (PROMPT_TOKENS,), generator=generator).tolist() for _ in modes]
    # the student role's arguments (fastdistill serve-student's: the generate route among them) plus a small KV
    # block; the prefix cache is vLLM's default (the log says whether it is on)
    args = ["--block-size", str(BLOCK)]
    server = VLLMServer(folder, role="student", weight_transfer_backend="gloo", extra_args=args,
                        max_model_len=PROMPT_TOKENS + MAX_TOKENS + 64, log_path=work / "student.log")
    results = []
    with server:
        version = _vllm_version(server)
        for index, mode in enumerate(modes):
            for attempt in range(1, ATTEMPTS + 1):
                versions = {"A": 100 + 2 * (index * ATTEMPTS + attempt), "B": 101 + 2 * (index * ATTEMPTS + attempt)}
                prompt = prompts[index] if attempt == 1 else torch.randint(
                    3, config.vocab_size, (PROMPT_TOKENS,), generator=generator).tolist()
                result = run_mode(mode, server, models, prompt, versions, seed + index)
                result["attempts"] = attempt
                if "finding" not in result:
                    break
            results.append(result)
    log = (work / "student.log").read_text(errors="replace")
    caching = "enable_prefix_caching=True" in log
    return {"date": datetime.now(UTC).isoformat(timespec="seconds"), "machine": platform.node(),
            "python": sys.version.split()[0], "vllm": version, "block_size": BLOCK,
            "prefix_caching": caching if caching or "enable_prefix_caching=False" in log else None,
            "prompt_tokens": PROMPT_TOKENS, "max_tokens": MAX_TOKENS, "results": results}


def _vllm_version(server: VLLMServer) -> str:
    try:
        with urllib.request.urlopen(f"{server.url}/version", timeout=10) as response:
            return json.loads(response.read()).get("version", "?")
    except OSError:
        return "? (server stopped)"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--json", default=str(Path(__file__).parent / "results" / "keep_mode_probe.json"))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="keep-mode-probe-") as work:
        report = probe(args.modes, Path(work))
    print(f"{'mode':14} {'push@':>6} {'switch':>6} {'label@':>6} {'<sw vs A':>9} {'>sw vs B':>9} {'>sw vs mix':>10} "
          f"{'unsettled':>9} {'prefix KV':34} {'new request':16}")
    for r in report["results"]:
        if "prefix_kv" not in r:
            print(f"{r['mode']:14} {r['finding']}")
            continue
        print(f"{r['mode']:14} {r['push_started_after_tokens']:>6} {r['switch']:>6} {str(r['labelled_switch']):>6} "
              f"{r['before_switch_max_abs_vs_A']:9.1e} {r['after_switch_max_abs_vs_B']:9.1e} "
              f"{r['after_switch_max_abs_vs_mixed']:10.1e} {r['tokens_before_settling_on_B']:>9} {r['prefix_kv']:34} "
              f"{r['prefix_cache']['serves']:16}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
