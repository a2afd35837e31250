"""The engine's exceptions: transient refusal, and the outcomes `RequestHandle.get()` raises."""


class SubmitError(RuntimeError):
    """Transient refusal (backpressure or shutting down): the request was not accepted; retry."""

    def __init__(self, message: str, *, shutting_down: bool = False) -> None:
        super().__init__(message)
        self.shutting_down = shutting_down


class RequestCancelled(RuntimeError):
    pass


class RequestFailed(RuntimeError):
    pass
