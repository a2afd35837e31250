"""The knobs of a deployment that every layer names the same way (torch-free)."""

from __future__ import annotations

# How a model's linear layers may run their matmuls (see `model/checkpoints/loader.build_model`).
QUANTIZATIONS = ("auto", "none", "int8", "q4", "fp8")
# What the KV cache holds keys and values in: "auto", the model's dtype; "fp8", float8 e4m3.
KV_CACHE_DTYPES = ("auto", "fp8")
