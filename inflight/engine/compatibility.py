"""`BatchCompatibility`: whether a queued request may share a step with the running batch.

Every request field is in exactly one list below (a test fails when a new field is in none):
payload that never concerns the batch, fields two requests must agree on unless the runtime
declares that it applies them per row, or request options no runtime serves yet, which the
options table's rule refuses when a request is checked (`protocol/options.py`), so they never
reach admission.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from inflight.protocol.request import GenerationRequest, SamplingParams

# The request's own data: it travels with its row.
PAYLOAD_FIELDS = frozenset(
    {
        "prompt_token_ids",
        "media",
        "system_prompt_tokens",
        "intent",
        "params.stop",
        "params.stop_token_ids",
        "params.logit_bias",
        "params.min_tokens",
        "priority",  # the engine's queue order
        "params.include_stop_str_in_output",
    }
)

# Compared, in the order a first difference is reported, unless applied per row.
BATCH_FIELDS = (
    "params.temperature",
    "params.top_p",
    "params.top_k",
    "params.min_p",
    "params.presence_penalty",
    "params.frequency_penalty",
    "params.repetition_penalty",
    "params.seed",  # compared as "has a seed": seeded rows switch the batch to stable sampling
    "params.max_tokens",
    "params.logprobs",
    "params.prompt_logprobs",
    "params.skip_special_tokens",
    "params.ignore_eos",
    "params.reuse_context",
    "params.cache_generated_tokens",
    "params.structured_outputs",
    "params.n",
    "params.speculative",
    "lora_name",
    "save_system_prompt_kv_cache",
    "speech",
    "generate_audio",
    "diffusion",
)

# Ruled by the options table: no runtime serves them yet, so a request asking for one is refused
# when checked and never reaches admission.
OPTION_RULED_FIELDS = frozenset({"past_trajectory"})


def request_fields() -> set[str]:
    """Every field of a request, sampling parameters as "params.<name>"."""
    top = {f.name for f in fields(GenerationRequest) if f.name != "params"}
    return top | {f"params.{f.name}" for f in fields(SamplingParams)}


def _value(request: GenerationRequest, name: str) -> Any:
    obj: Any = request
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj is not None if name == "params.seed" else obj


class BatchCompatibility:
    def __init__(self, per_row_fields: frozenset[str] = frozenset()) -> None:
        unknown = per_row_fields - request_fields()
        if unknown:
            raise ValueError(f"per-row fields that no request has: {sorted(unknown)}")
        self.compared = tuple(f for f in BATCH_FIELDS if f not in per_row_fields)

    def first_difference(self, a: GenerationRequest, b: GenerationRequest) -> str | None:
        return next((f for f in self.compared if _value(a, f) != _value(b, f)), None)

    def compatible(self, a: GenerationRequest, b: GenerationRequest) -> bool:
        return self.first_difference(a, b) is None
