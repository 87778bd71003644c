"""The output head of a Hugging Face causal LM as one pair of scalars, read once from its config.

Every family's ``ForCausalLM.forward`` turns the last hidden state ``h`` into logits as ``lm_head(h)`` followed by
at most a scale and a tanh softcap. :class:`LogitHead` holds those two scalars, :func:`logit_head_from_config` reads
them from a config (a ``PretrainedConfig`` or a parsed ``config.json``), and :func:`head_logits` applies them:

    z = softcap(scale · (h Wᵀ + b)) / T,      softcap(x) = c · tanh(x / c)

What each family's forward does (transformers 5), and so what is read:

- Cohere, Cohere2, Cohere2-MoE: ``logits * logit_scale``.
- Granite and its MoE / hybrid / SWA variants: ``logits / logits_scaling``; MiniCPM3 divides the hidden states by
  ``logits_scaling = hidden_size / dim_model_base`` before its bias-free lm_head, the same thing.
- HyperCLOVA X: ``logits * logits_scaling`` (the same attribute name as Granite's, the opposite operation).
- Falcon-H1: ``logits * lm_head_multiplier``.
- Gemma2, Gemma3, Gemma3n, Gemma4, VaultGemma, NanoChat: ``final_logit_softcapping``; RecurrentGemma:
  ``logits_soft_cap``.
- Every other family: plain ``lm_head(h)``, provided its config carries no setting that looks like one of the above
  (a name mentioning logits, the lm_head, an output multiplier or a µP width, see :data:`HEAD_LOOKING`): a family
  this module does not know and whose config has one (remote code such as MiniCPM's ``dim_model_base``, xLSTM's
  ``output_logit_soft_cap``) is refused with a :class:`~fastdistill.errors.ConfigError` rather than trained on
  logits that are not the ones the model (and vLLM) computes.

The student's loss path, the hidden-state teacher's head, the policy-gradient and importance-ratio paths,
evaluation, the TRL drop-ins and the weight-sync check all read the head here.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fastdistill.errors import ConfigError


@dataclass(frozen=True)
class LogitHead:
    """The scalars between ``lm_head(h)`` and the logits: ``z = softcap(scale · lm_head(h))``.

    ``scale`` > 0 multiplies the raw logits; ``softcap`` (None: none) is the tanh cap ``c·tanh(x/c)`` applied after
    the scale. ``family`` names the rule they were read by (the config's ``model_type``), for messages."""

    scale: float = 1.0
    softcap: float | None = None
    family: str = "plain"

    def __post_init__(self) -> None:
        if not (math.isfinite(self.scale) and self.scale > 0):
            raise ConfigError(f"{self.family}: the logit scale must be a finite number > 0, got {self.scale!r}")
        if self.softcap is not None and not (math.isfinite(self.softcap) and self.softcap > 0):
            raise ConfigError(f"{self.family}: the logit softcap must be None or a finite number > 0, "
                              f"got {self.softcap!r}")


PLAIN_HEAD = LogitHead()

Getter = Callable[[str], Any]

SOFTCAP_FAMILIES = ("gemma2", "gemma3", "gemma3_text", "gemma3n", "gemma3n_text", "gemma4", "gemma4_text",
                    "vaultgemma", "nanochat")
DIVIDE_LOGITS_SCALING = ("granite", "granite_swa", "granitemoe", "granitemoe_swa", "granitemoehybrid",
                         "granitemoeshared")


def _number(get: Getter, key: str, family: str) -> float | None:
    value = get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{family}: config attribute {key}={value!r} must be a number")
    return float(value)


def _multiply(key: str) -> Callable[[Getter, str], LogitHead]:
    def rule(get: Getter, family: str) -> LogitHead:
        value = _number(get, key, family)
        return LogitHead(1.0 if value is None else value, None, family)
    return rule


def _divide(key: str) -> Callable[[Getter, str], LogitHead]:
    def rule(get: Getter, family: str) -> LogitHead:
        value = _number(get, key, family)
        return LogitHead(1.0 if value is None else 1.0 / value, None, family)
    return rule


def _softcap(key: str) -> Callable[[Getter, str], LogitHead]:
    def rule(get: Getter, family: str) -> LogitHead:
        value = _number(get, key, family)
        return LogitHead(1.0, value or None, family)  # 0 / None: no cap
    return rule


def _minicpm3(get: Getter, family: str) -> LogitHead:
    hidden = _number(get, "hidden_size", family)
    base = _number(get, "dim_model_base", family) or hidden
    return LogitHead(1.0 if hidden is None else base / hidden, None, family)


HEAD_RULES: dict[str, Callable[[Getter, str], LogitHead]] = {
    "cohere": _multiply("logit_scale"),
    "cohere2": _multiply("logit_scale"),
    "cohere2_moe": _multiply("logit_scale"),
    "falcon_h1": _multiply("lm_head_multiplier"),
    "hyperclovax": _multiply("logits_scaling"),
    "minicpm3": _minicpm3,
    "recurrent_gemma": _softcap("logits_soft_cap"),
    **{family: _divide("logits_scaling") for family in DIVIDE_LOGITS_SCALING},
    **{family: _softcap("final_logit_softcapping") for family in SOFTCAP_FAMILIES},
}

# Config attributes of an unknown family that may change its logits after the lm_head: a name mentioning logits,
# the lm_head, an output multiplier / scale, µP or a base width; unless it is about attention or routing, or is
# one of the known unrelated settings.
HEAD_LOOKING = re.compile(r"logit|lm_head|output_mult|output_scal|mup|dim_model_base|width_mult")
NOT_HEAD = re.compile(r"^(attn|attention|router|moe_router)_|logits_to_keep$|^output_router_logits$|"
                      r"^chunk_size_lm_head$")


def _is_neutral(key: str, value: Any) -> bool:
    """Whether ``value`` of head-looking attribute ``key`` leaves the logits alone (None, a flag, 1 for a scale,
    0 for a cap)."""
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return True
    return float(value) == (0.0 if "cap" in key else 1.0)


def _sections(config: Any) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
    """``(text config, top level)`` as mappings, for a ``PretrainedConfig`` or a parsed config.json."""
    if isinstance(config, Mapping):
        text = config.get("text_config")
        return (text if isinstance(text, Mapping) else config), config
    top = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
    text = config
    if hasattr(config, "get_text_config"):
        try:
            text = config.get_text_config()
        except ValueError:  # several text configs (encoder-decoder): the top level
            text = config
    text_dict = text.to_dict() if hasattr(text, "to_dict") else dict(vars(text))
    return text_dict, top


def logit_head_from_config(config: Any) -> LogitHead:
    """The :class:`LogitHead` of a model from its config: a transformers ``PretrainedConfig`` (any object with the
    attributes) or a parsed ``config.json`` dict. Multimodal configs are read from their text config, falling back
    to the top level per attribute.

    Raises :class:`~fastdistill.errors.ConfigError` for a family this module does not know whose config has a
    non-neutral attribute that looks like a logit setting (naming it), and for a non-numeric or non-positive one."""
    text, top = _sections(config)

    def get(key: str) -> Any:
        return text[key] if key in text else top.get(key)

    family = str(text.get("model_type") or top.get("model_type") or "")
    rule = HEAD_RULES.get(family) or HEAD_RULES.get(str(top.get("model_type") or ""))
    if rule is not None:
        return rule(get, family)
    suspicious = sorted({key for section in (text, top) for key, value in section.items()
                         if HEAD_LOOKING.search(key) and not NOT_HEAD.search(key) and not _is_neutral(key, value)})
    if suspicious:
        settings = ", ".join(f"{key}={get(key)!r}" for key in suspicious)
        raise ConfigError(
            f"model_type {family or '(none)'!r}: its config has {settings}, which may change the logits after the "
            f"lm_head, and fastdistill does not know what this family's forward does with it (known families: "
            f"{', '.join(sorted(HEAD_RULES))}; others must have a plain lm_head). Training on logits the model does "
            "not compute would be silently wrong: add the family's rule to fastdistill.logit_head.HEAD_RULES")
    return LogitHead(1.0, None, family or "plain")


def head_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                head: LogitHead | None = None, *, temperature: float = 1.0,
                dtype: torch.dtype | None = None) -> torch.Tensor:
    """Logits ``softcap(scale · (hidden @ weight.T + bias)) / temperature``: ``hidden`` (..., D), ``weight`` (V, D),
    ``bias`` (V,) or None; returns (..., V) in ``dtype`` (default: the common dtype of hidden and weight, at least
    float32); ``head`` None is a plain head. Materialises the whole (..., V) tensor: the unfused paths call it on
    bounded row chunks."""
    head = head if head is not None else PLAIN_HEAD
    if dtype is None:
        dtype = torch.promote_types(torch.promote_types(hidden.dtype, weight.dtype), torch.float32)
    logits = torch.nn.functional.linear(hidden.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype))
    if head.scale != 1.0:
        logits = logits * head.scale
    if head.softcap is not None:
        logits = head.softcap * torch.tanh(logits / head.softcap)
    if temperature != 1.0:
        logits = logits / temperature
    return logits


def causal_lm_parts(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """``(backbone, lm_head)`` of a Hugging Face causal LM, a peft-wrapped one included: the module whose forward
    returns ``last_hidden_state`` and the output embedding (``weight`` (V, D), ``bias`` or None)."""
    causal_lm = model.get_base_model() if hasattr(model, "peft_config") else model
    return causal_lm.base_model, causal_lm.get_output_embeddings()


def causal_lm_logits(model: torch.nn.Module, input_ids: torch.Tensor, *, position_ids: torch.Tensor | None = None,
                     attention_mask: torch.Tensor | None = None, temperature: float = 1.0,
                     dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
    """The logits fastdistill trains on, (B, L, V): the backbone's last hidden states through the lm_head and the
    config's :class:`LogitHead` (:func:`head_logits` in ``dtype``). They equal ``model(input_ids).logits`` for every
    family :func:`logit_head_from_config` accepts."""
    backbone, lm_head = causal_lm_parts(model)
    kwargs = {"input_ids": input_ids, "use_cache": False}
    if position_ids is not None:
        kwargs["position_ids"] = position_ids
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask
    hidden = backbone(**kwargs).last_hidden_state
    return head_logits(hidden, lm_head.weight, lm_head.bias, logit_head_from_config(model.config),
                       temperature=temperature, dtype=dtype)
