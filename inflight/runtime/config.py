"""`RuntimeConfig`: what a runtime is built with (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass

from inflight.protocol.deployment import KV_CACHE_DTYPES, QUANTIZATIONS
from inflight.runtime.host.speculative import SpeculativeConfig


@dataclass(frozen=True)
class RuntimeConfig:
    """Capacity of a runtime, and how it runs the model.

    `max_batch_size` resident slots; sequences (prompt plus output) of at most `max_model_len`
    tokens (default: the model's context, capped at 4096); a KV cache of `num_kv_blocks` blocks of
    `block_size` tokens (default: enough for every slot to hold a full-length sequence); at most
    `max_num_tokens` tokens computed per step (decode rows plus prefill chunks).
    """

    max_batch_size: int = 8
    # False: the blocking path, each batch one request served alone (`host/blocking.py`).
    in_flight_batching: bool = True
    max_model_len: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    max_num_tokens: int = 2048
    context_cache: bool = True  # reuse the KV of prompt prefixes computed before
    dtype: str | None = None  # default: float32 on CPU, bfloat16 on CUDA
    # "auto": a GGUF file's weights run in the CPU kernel of their stored type where one exists
    # (Q4_1 -> q4, Q8_0 -> int8), float32 otherwise; "none": float32 (bf16 on CUDA), exactly;
    # "int8": int8 weights for every CPU matmul; "q4": 4-bit weights (GGUF's Q4_1) for the
    # decoder layers' matmuls and int8 for the head. Those two are CPU float32 only; "fp8": FP8
    # decoder weights (a scale per output channel, activations per token) on CUDA GPUs with FP8
    # tensor cores.
    quantization: str = "auto"
    # "auto": keys and values in the model's dtype; "fp8": in float8 e4m3 (half the bytes a
    # decode step reads; uncalibrated, scale 1: values beyond +-448 are clamped), CUDA with the
    # triton attention backend only.
    kv_cache_dtype: str = "auto"
    device: str | None = None  # default: cuda when available
    # "torch", "cpu" or "triton"; default: triton on CUDA, cpu (its native decode kernel) for
    # float32 on the CPU where it builds, else torch.
    attention_backend: str | None = None
    cuda_graphs: bool = True  # capture decode steps (CUDA with the triton backend only)
    # Complete each step while the device runs the next (default: on CUDA, off on the CPU).
    overlap: bool | None = None
    seed: int | None = None
    # LoRA: adapter slots in the model (0: LoRA off), and the largest rank an adapter may have.
    max_loras: int = 0
    max_lora_rank: int = 16
    # Speculative decoding (None: off).
    speculative: SpeculativeConfig | None = None
    # Encoder outputs kept for media seen again (models with image input), in MiB.
    encoder_cache_mb: int = 256
    # Ranks the model is split over (see runtime/parallel.py): one process each, one GPU each
    # on CUDA.
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "block_size", "max_num_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("max_model_len", "num_kv_blocks"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 2):
                raise ValueError(f"{name} must be an integer >= 2, got {value!r}")
        if self.max_num_tokens < self.max_batch_size:
            raise ValueError(
                f"max_num_tokens ({self.max_num_tokens}) must be at least max_batch_size "
                f"({self.max_batch_size}): every resident decodes one token per step"
            )
        if self.attention_backend not in (None, "torch", "cpu", "triton"):
            raise ValueError(
                f"attention_backend must be torch, cpu or triton, got {self.attention_backend!r}"
            )
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}"
            )
        if not isinstance(self.encoder_cache_mb, int) or self.encoder_cache_mb < 0:
            raise ValueError(
                f"encoder_cache_mb must be an integer >= 0, got {self.encoder_cache_mb!r}"
            )
        if not isinstance(self.max_loras, int) or self.max_loras < 0:
            raise ValueError(f"max_loras must be an integer >= 0, got {self.max_loras!r}")
        if not isinstance(self.max_lora_rank, int) or self.max_lora_rank < 1:
            raise ValueError(
                f"max_lora_rank must be a positive integer, got {self.max_lora_rank!r}"
            )
        tp = self.tensor_parallel_size
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {tp!r}")
        if tp > 1 and (self.max_loras or self.speculative is not None):
            raise ValueError(
                "LoRA and speculative decoding are not served with tensor parallelism "
                f"(tensor_parallel_size={tp})"
            )
        if self.dtype not in (None, "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                f"got {self.kv_cache_dtype!r}"
            )
        if self.kv_cache_dtype == "fp8" and (
            self.device == "cpu" or self.attention_backend in ("torch", "cpu")
        ):
            raise ValueError(
                "kv_cache_dtype='fp8' needs a CUDA device and the triton attention backend, got "
                f"device={self.device!r}, attention_backend={self.attention_backend!r}"
            )
