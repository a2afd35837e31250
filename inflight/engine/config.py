"""`EngineConfig`: the request engine's limits."""

from __future__ import annotations

from dataclasses import dataclass

from inflight.protocol.deployment import SCHEDULING_POLICIES
from inflight.protocol.request import GenerationRequest, RequestFieldError


@dataclass(frozen=True)
class EngineConfig:
    """`max_batch_size`: residents at once (above 1, joiners are admitted mid-flight).
    `max_pending_requests`: accepted requests not yet terminal, queued or resident; the real
    backpressure. `command_queue_capacity`: submits posted but not yet taken by the actor.
    `idle_wait`: seconds an idle actor sleeps before looking again (every submit, cancel and
    shutdown also wakes it). `scheduling_policy`: the order queued requests are seated in,
    "fcfs" (arrival) or "priority" (`GenerationRequest.priority`, lower first, then arrival)."""

    max_batch_size: int = 1
    max_pending_requests: int = 256
    command_queue_capacity: int = 64
    idle_wait: float = 0.05
    scheduling_policy: str = "fcfs"

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_pending_requests", "command_queue_capacity"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.idle_wait, int | float) or not self.idle_wait > 0:
            raise ValueError(
                f"idle_wait must be a positive number of seconds (0 would spin), "
                f"got {self.idle_wait!r}"
            )
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be fcfs or priority, got {self.scheduling_policy!r}"
            )

    def check(self, request: GenerationRequest) -> None:
        """A RequestFieldError for a priority the policy does not order by."""
        if request.priority and self.scheduling_policy != "priority":
            raise RequestFieldError(
                f"priority {request.priority} orders the queue only under the priority "
                "scheduling policy; start with scheduling_policy='priority' "
                "(--scheduling-policy priority) or send priority 0",
                "priority",
            )
