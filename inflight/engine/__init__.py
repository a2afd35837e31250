"""The request engine: in-flight batching over any `SteppedExecution` (no torch here)."""

from inflight.engine.channel import StreamChannel
from inflight.engine.compatibility import BatchCompatibility
from inflight.engine.config import EngineConfig
from inflight.engine.coordinator import RequestCoordinator
from inflight.engine.engine import RequestEngine, ShutdownMode
from inflight.engine.errors import RequestCancelled, RequestFailed, SubmitError
from inflight.engine.metrics import EngineMetrics
from inflight.engine.record import RequestHandle, TerminalStatus

__all__ = [
    "BatchCompatibility",
    "EngineConfig",
    "EngineMetrics",
    "RequestCancelled",
    "RequestCoordinator",
    "RequestEngine",
    "RequestFailed",
    "RequestHandle",
    "ShutdownMode",
    "StreamChannel",
    "SubmitError",
    "TerminalStatus",
]
