"""inflight: an LLM serving engine with in-flight batching.

`LLM` and `SamplingParams` are imported lazily, so that importing a torch-free layer
(`inflight.engine`) does not pull in torch.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from inflight.api import LLM, StreamDelta
    from inflight.runtime.request import SamplingParams
    from inflight.runtime.stepped import CompletionOutput

__all__ = ["LLM", "SamplingParams", "StreamDelta", "CompletionOutput"]


def __getattr__(name: str) -> Any:
    if name in ("LLM", "StreamDelta"):
        from inflight import api

        return getattr(api, name)
    if name == "SamplingParams":
        from inflight.runtime.request import SamplingParams

        return SamplingParams
    if name == "CompletionOutput":
        from inflight.runtime.stepped import CompletionOutput

        return CompletionOutput
    raise AttributeError(f"module 'inflight' has no attribute {name!r}")
