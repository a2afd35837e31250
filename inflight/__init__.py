"""inflight: an LLM serving engine with in-flight batching.

`LLM` and `SamplingParams` are imported lazily, so that importing a torch-free layer
(`inflight.engine`) does not pull in torch.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from inflight.api import LLM
    from inflight.engine import RequestHandle
    from inflight.protocol.outputs import CompletionOutput, RequestOutput, StreamChunk
    from inflight.protocol.request import AudioReply, DiffusionParams, SamplingParams

__all__ = [
    "LLM",
    "SamplingParams",
    "AudioReply",
    "DiffusionParams",
    "RequestHandle",
    "StreamChunk",
    "RequestOutput",
    "CompletionOutput",
]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from inflight.api import LLM

        return LLM
    if name == "RequestHandle":
        from inflight.engine import RequestHandle

        return RequestHandle
    if name in ("SamplingParams", "AudioReply", "DiffusionParams"):
        from inflight.protocol import request

        return getattr(request, name)
    if name in ("CompletionOutput", "RequestOutput", "StreamChunk"):
        from inflight.protocol import outputs

        return getattr(outputs, name)
    raise AttributeError(f"module 'inflight' has no attribute {name!r}")
