"""A canvas being denoised, and one denoising step of it (on the device).

Each request draws from a generator of its own, in the order transformers' `generate()` draws
from torch's: the canvas's uniform ids, then at every step the multinomial sample of each
position and the uniform redraw of the positions not accepted. A request's canvases are then
the same bits alone, beside any batchmates, and as `generate()` makes them under the same seed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from inflight.runtime.diffusion.requests import Denoising


@dataclass
class Canvas:
    """One canvas of a request: its current ids [1, L], the self-conditioning of its next step
    (None before the first: zeros), the last argmax [1, L] and the argmax history of the
    stability test [stability, 1, L], and the steps it has left."""

    ids: torch.Tensor
    left: int
    soft: torch.Tensor | None = None
    argmax: torch.Tensor | None = None
    history: torch.Tensor | None = None


class CanvasSampler:
    """Starts and steps a request's canvases of `length` ids over `vocab`, from `generator`."""

    def __init__(
        self,
        settings: Denoising,
        vocab: int,
        length: int,
        generator: torch.Generator,
    ) -> None:
        self.settings = settings
        self.vocab = vocab
        self.length = length
        self.generator = generator

    def start(self) -> Canvas:
        """A canvas of uniformly random ids."""
        return Canvas(self._uniform(), self.settings.steps)

    def step(
        self,
        canvas: Canvas,
        logits: torch.Tensor,
        soft: Callable[[torch.Tensor], torch.Tensor],
    ) -> bool:
        """Take the denoiser's float32 `logits` [L, V] of `canvas` in: sample, accept the
        positions the entropy bound allows, redraw the others, keep the argmax and the
        self-conditioning (`soft` of the scaled logits); whether the canvas is done (settled,
        or out of steps)."""
        s = self.settings
        if s.temperature == 0:
            argmax = logits.argmax(-1)[None]
            entropy = torch.zeros_like(logits[:, 0])[None]
            sampled = argmax
            keep = torch.ones_like(argmax, dtype=torch.bool)
            conditioning = soft(logits / 1e-6)
        else:
            scaled = logits / s.scale(canvas.left)
            probs = torch.softmax(scaled, dim=-1, dtype=torch.float32)
            sampled = torch.multinomial(probs, 1, generator=self.generator).view(1, -1)
            argmax = scaled.argmax(-1)[None]
            entropy = torch.distributions.Categorical(logits=scaled).entropy()[None]
            ordered, order = torch.sort(entropy, dim=-1)
            accepted = torch.cumsum(ordered, dim=-1) - ordered <= s.entropy_bound
            keep = torch.zeros_like(accepted).scatter(-1, order, accepted)
            conditioning = soft(scaled)
        accepted_ids = torch.where(keep, sampled, canvas.ids)
        canvas.ids = torch.where(~keep, self._uniform(), accepted_ids)
        stable = self._stable(canvas, argmax)
        canvas.argmax, canvas.soft = argmax, conditioning
        canvas.left -= 1
        confident = bool(entropy.mean() < s.confidence_threshold)
        return canvas.left == 0 or (confident and stable)

    def _stable(self, canvas: Canvas, argmax: torch.Tensor) -> bool:
        """Whether `argmax` equals each of the last `stability_threshold` ones (recorded)."""
        n = self.settings.stability_threshold
        if n == 0:
            return True
        if canvas.history is None:
            canvas.history = torch.full(
                (n, *argmax.shape), -1, dtype=argmax.dtype, device=argmax.device
            )
        stable = bool((canvas.history == argmax[None]).all())
        canvas.history = torch.roll(canvas.history, shifts=-1, dims=0)
        canvas.history[-1] = argmax
        return stable

    def _uniform(self) -> torch.Tensor:
        return torch.randint(
            0,
            self.vocab,
            (1, self.length),
            generator=self.generator,
            device=self.generator.device,
        )
