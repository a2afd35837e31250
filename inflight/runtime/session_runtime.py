"""`SessionRuntime`: what the runtimes of models that step in a session of their own kind
share (a text-to-speech model's `SpeechRuntime`, a block-diffusion model's `DiffusionRuntime`):
they run in this process alone (no fault to report, nothing to stop), one session at a time,
and serve no LoRA adapters."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from inflight.model.checkpoints.loader import Checkpoint
from inflight.protocol.stepped import ExecutionCapabilities, SteppedExecution
from inflight.runtime.deployment import PER_ROW_FIELDS, DeploymentPlan
from inflight.runtime.host.slots import ResidentSlots

S = TypeVar("S", bound=SteppedExecution)


class SessionRuntime(Generic[S]):
    """A subclass sets `checkpoint`, `plan` and `slots`, names its model for refusals
    (`model_kind`: "a text-to-speech model") and opens its session in `_open`."""

    model_kind: str
    checkpoint: Checkpoint
    plan: DeploymentPlan
    slots: ResidentSlots
    _session: S | None = None

    @property
    def model_name(self) -> str:
        return self.checkpoint.name

    @property
    def fault(self) -> str | None:
        return None

    @property
    def capabilities(self) -> ExecutionCapabilities:
        return ExecutionCapabilities(
            stepped=True,
            seated_admission=True,
            max_batch_size=self.slots.capacity,
            per_row_fields=PER_ROW_FIELDS | self.plan.served_options,
        )

    def new_session(self) -> S:
        """The execution for one batch; a runtime runs one at a time."""
        if self._session is not None:
            raise RuntimeError(f"a session of {self.model_kind} is already open on this runtime")
        self._session = self._open(self._session_finished)
        return self._session

    def _open(self, on_finish: Callable[[], None]) -> S:
        raise NotImplementedError

    def _session_finished(self) -> None:
        self._session = None

    def close(self) -> None:
        """Nothing to stop: it runs in this process alone."""

    def register_lora(self, name: str, path: str) -> None:
        raise ValueError(f"LoRA is not served for {self.model_kind}")

    def unregister_lora(self, name: str) -> None:
        raise KeyError(name)

    def lora_names(self) -> list[str]:
        return []
