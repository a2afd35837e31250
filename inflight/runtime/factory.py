"""Which runtime a checkpoint gets: a text-to-speech model's (`speech/`), a block-diffusion
model's (`diffusion/`), or the text one."""

from __future__ import annotations

from pathlib import Path

from inflight.model.checkpoints.loader import Checkpoint, open_checkpoint
from inflight.protocol.deployment import DeploymentOptions
from inflight.runtime.device.openmp_pool import release_thread_pool
from inflight.runtime.diffusion.runtime import DiffusionRuntime
from inflight.runtime.runtime import Runtime
from inflight.runtime.speech.runtime import SpeechRuntime


def open_runtime(
    model: str | Path | Checkpoint | None,
    options: DeploymentOptions,
    show_progress: bool = False,
) -> Runtime | SpeechRuntime | DiffusionRuntime:
    checkpoint = open_checkpoint(model)
    if checkpoint.config.speech is not None:
        runtime = SpeechRuntime(checkpoint, options, show_progress)
    elif checkpoint.config.diffusion is not None:
        runtime = DiffusionRuntime(checkpoint, options, show_progress)
    else:
        runtime = Runtime(checkpoint, options, show_progress)
    # The steps run on the engine's thread: this one's OpenMP workers would only slow them.
    release_thread_pool()
    return runtime
