"""The knobs of a deployment (torch-free): one name and one default for each, the same for
`LLM(...)`, `inflight serve` and `inflight bench` (whose command lines are generated from these
fields: `--max-model-len` for `max_model_len`). Each knob's own validity is checked here; what
the knobs resolve to on a given model and machine, and which combinations are refused, is the
deployment plan's (`runtime/deployment.py`)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from inflight.protocol.request import is_int

# How a model's linear layers may run their matmuls (see `model/checkpoints/loader.build_model`).
QUANTIZATIONS = ("auto", "none", "int8", "q4", "fp8")
# What the KV cache holds keys and values in: "auto", the model's dtype; "fp8", float8 e4m3.
KV_CACHE_DTYPES = ("auto", "fp8")
SCHEDULING_POLICIES = ("fcfs", "priority")
DTYPES = ("float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("torch", "cpu", "triton")
DEVICES = ("cpu", "cuda")
MEDIA_KINDS = ("image", "audio")


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config`: up to `num_speculative_tokens` drafts per row and step, by
    `method` "ngram" (prompt lookup: the tokens that followed the latest earlier occurrence of
    the output's last n tokens, n from `prompt_lookup_max` down to `prompt_lookup_min`) or
    "draft_model" (the greedy tokens of the checkpoint at `model`, which needs the target's
    vocabulary; giving `model` alone picks it)."""

    num_speculative_tokens: int
    method: str = "ngram"
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    model: str | None = None

    def __post_init__(self) -> None:
        if self.method not in ("ngram", "draft_model"):
            raise ValueError(
                f"speculative method must be 'ngram' or 'draft_model', got {self.method!r}"
            )
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("a draft model is given by `model`, with method 'draft_model' only")
        k = self.num_speculative_tokens
        if not is_int(k) or not 1 <= k <= 16:
            raise ValueError(f"num_speculative_tokens must be an integer in 1..16, got {k!r}")
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if not (is_int(low) and is_int(high)):
            raise ValueError("prompt_lookup_min and prompt_lookup_max must be integers")
        if not 1 <= low <= high:
            raise ValueError(
                f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {low} and {high}"
            )

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> SpeculativeConfig:
        """From the JSON object `--speculative-config` takes (unknown keys are refused)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(
                f"speculative_config has unknown keys {unknown}; known: {sorted(known)}"
            )
        if "num_speculative_tokens" not in values:
            raise ValueError("speculative_config needs num_speculative_tokens")
        values = dict(values)
        if values.get("model") is not None:
            values.setdefault("method", "draft_model")
        return cls(**values)


def knob(default: Any, help: str, **cli: Any) -> Any:
    """A deployment knob: its default and its help, and how its command-line flag reads it
    where the type alone does not say (`choices`, `parse` for a JSON object or NAME=PATH
    pairs, `metavar`, a short `alias`)."""
    factory = {"default_factory": dict} if default == {} else {"default": default}
    return field(metadata={"help": help, **cli}, **factory)


@dataclass(frozen=True)
class DeploymentOptions:
    """What a deployment is asked to be. The defaults serve the embedded model on this
    machine: in-flight batching off (the blocking path), the context cache on, CUDA where there
    is one, float32 on the CPU and bfloat16 on CUDA."""

    enable_in_flight_batching: bool = knob(
        False, "admit queued requests into the running batch (default: one request at a time)"
    )
    max_batch_size: int = knob(8, "requests generating at once under in-flight batching")
    max_queued_requests: int = knob(
        4096,
        "requests waiting beyond the batch before refusals (a 429 over HTTP); a request asking "
        "for more sequences than the batch and this together can never fit (a 400)",
    )
    scheduling_policy: str = knob(
        "fcfs",
        "the order queued requests are seated in: fcfs (arrival), or priority (a request's "
        "priority, lower first, as vLLM's; arrival among equals; nothing running is preempted)",
        choices=SCHEDULING_POLICIES,
    )
    max_model_len: int | None = knob(
        None,
        "longest sequence (prompt + output) in tokens (default: the model's context, capped "
        "at 4096)",
    )
    max_num_tokens: int = knob(2048, "tokens computed per step (decode rows plus prefill chunks)")
    block_size: int = knob(16, "tokens per KV cache block")
    num_kv_blocks: int | None = knob(
        None, "KV cache blocks (default: every request of the batch at max_model_len)"
    )
    enable_context_reuse: bool = knob(
        True, "reuse the KV of prompt prefixes computed before (the context cache, prefix caching)"
    )
    max_pinned_prefix_tokens: int | None = knob(
        None,
        "tokens of KV that pinned prefixes (save_system_prompt_kv_cache, warm-up prompts) may "
        "hold in the context cache (default: a quarter of the KV cache)",
    )
    device: str | None = knob(
        None, "cpu or cuda (default: cuda where there is one)", choices=DEVICES
    )
    dtype: str | None = knob(
        None, "the model's dtype (default: float32 on the CPU, bfloat16 on CUDA)", choices=DTYPES
    )
    quantization: str = knob(
        "auto",
        "auto: a GGUF file's Q4_1 / Q8_0 / Q4_K / Q5_K / Q6_K weights run in the CPU kernels of "
        "their own type (fast, not bit-exact), others in float32; none: float32 (bf16 on CUDA), "
        "exact; int8 / q4: quantize every CPU matmul (q4: 4-bit GGUF Q4_1 form, head int8); "
        "fp8: FP8 decoder weights on CUDA GPUs with FP8 tensor cores (Ada, Hopper)",
        choices=QUANTIZATIONS,
    )
    kv_cache_dtype: str = knob(
        "auto",
        "auto: keys and values in the model's dtype; fp8: float8 e4m3 on CUDA with the triton "
        "attention backend (half the KV bytes; uncalibrated, values clamped at +-448)",
        choices=KV_CACHE_DTYPES,
    )
    attention_backend: str | None = knob(
        None,
        "torch, cpu or triton (default: triton on CUDA, cpu for float32 on the CPU where its "
        "kernel builds, else torch)",
        choices=ATTENTION_BACKENDS,
    )
    cuda_graphs: bool = knob(True, "replay captured CUDA graphs for decode steps (CUDA, triton)")
    batch_invariant: bool = knob(
        False,
        "each request's logits bit-identical whatever else shares its steps (CUDA: one Triton "
        "matmul tile shape for every step, unsplit decode attention; the CPU float32 path with "
        "its native attention is so already)",
    )
    overlap: bool | None = knob(
        None, "complete each step while the device runs the next (default: on CUDA only)"
    )
    seed: int | None = knob(None, "the sampler's seed, for requests without a seed of their own")
    enable_lora: bool = knob(False, "serve LoRA adapters: a request picks one by name")
    max_loras: int = knob(4, "LoRA adapters in the model at once")
    max_lora_rank: int = knob(16, "the largest LoRA rank served")
    lora_modules: Mapping[str, str] = knob(
        {},
        "PEFT adapters to serve from the start, each as name=path",
        parse="name=path",
        metavar="NAME=PATH",
    )
    speculative_config: SpeculativeConfig | None = knob(
        None,
        'speculative decoding, e.g. {"method": "ngram", "num_speculative_tokens": 4}',
        parse="json",
        metavar="JSON",
    )
    limit_mm_per_prompt: Mapping[str, int] = knob(
        {},
        'media items a prompt may hold, e.g. {"image": 4, "audio": 1} (default 4 each)',
        parse="json",
        metavar="JSON",
    )
    allow_media_fetch: bool = knob(
        False, "fetch http(s) image, audio and document URLs (default: data URLs)"
    )
    encoder_cache_mb: int = knob(256, "MiB of encoder outputs kept for media seen again")
    speech: bool = knob(
        True,
        "speak replies where the model can (Qwen3-Omni's talker); --no-speech serves text only, "
        "the talker not loaded",
    )
    tensor_parallel_size: int = knob(
        1,
        "split the model over this many ranks: one process each (one GPU each on CUDA)",
        alias="-tp",
    )

    def __post_init__(self) -> None:
        spec = self.speculative_config
        if spec is not None and not isinstance(spec, SpeculativeConfig):
            if not isinstance(spec, Mapping):
                raise ValueError(f"speculative_config must be a JSON object, got {spec!r}")
            object.__setattr__(self, "speculative_config", SpeculativeConfig.from_dict(spec))
        modules = dict(self.lora_modules or {})
        for name, path in modules.items():
            if not (
                isinstance(name, str) and name and isinstance(path, str | os.PathLike) and path
            ):
                raise ValueError(
                    f"lora_modules maps adapter names to paths, got {name!r}: {path!r}"
                )
        object.__setattr__(self, "lora_modules", {n: os.fspath(p) for n, p in modules.items()})
        object.__setattr__(self, "limit_mm_per_prompt", dict(self.limit_mm_per_prompt or {}))
        self._validate()

    def _validate(self) -> None:
        positive = (
            "max_batch_size",
            "max_num_tokens",
            "block_size",
            "max_loras",
            "max_lora_rank",
            "tensor_parallel_size",
        )
        for name in positive:
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not is_int(self.max_queued_requests) or self.max_queued_requests < 0:
            raise ValueError(
                f"max_queued_requests must be an integer >= 0, got {self.max_queued_requests!r}"
            )
        for name in ("max_model_len", "num_kv_blocks"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < 2):
                raise ValueError(f"{name} must be an integer >= 2, got {value!r}")
        pinned = self.max_pinned_prefix_tokens
        if pinned is not None and (not is_int(pinned) or pinned < 0):
            raise ValueError(f"max_pinned_prefix_tokens must be an integer >= 0, got {pinned!r}")
        if not is_int(self.encoder_cache_mb) or self.encoder_cache_mb < 0:
            raise ValueError(
                f"encoder_cache_mb must be an integer >= 0, got {self.encoder_cache_mb!r}"
            )
        if self.seed is not None and not is_int(self.seed):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        for f in fields(self):
            choices = f.metadata.get("choices")
            value = getattr(self, f.name)
            if choices and value is not None and value not in choices:
                raise ValueError(f"{f.name} must be one of {', '.join(choices)}, got {value!r}")
            if f.type in ("bool", "bool | None") and not isinstance(value, bool | None):
                raise ValueError(f"{f.name} must be true or false, got {value!r}")
        limits = self.limit_mm_per_prompt
        if set(limits) - set(MEDIA_KINDS) or not all(is_int(v) and v >= 0 for v in limits.values()):
            raise ValueError(
                "limit_mm_per_prompt takes {'image': count >= 0, 'audio': count >= 0}, got "
                f"{limits!r}"
            )
        if self.max_num_tokens < self.max_batch_size:
            raise ValueError(
                f"max_num_tokens ({self.max_num_tokens}) must be at least max_batch_size "
                f"({self.max_batch_size}): every resident decodes one token per step"
            )
