"""Canvases being denoised, and one denoising step of all that a forward computed (on the
device).

Each request draws from a generator of its own, in the order transformers' `generate()` draws
from torch's: the canvas's uniform ids, then at every step the multinomial sample of each
position and the uniform redraw of the positions not accepted. A request's canvases are then
the same bits alone, beside any batchmates, and as `generate()` makes them under the same seed.
Everything but those draws runs over the step's canvases at once, and the host reads one list
of which canvases are done.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from inflight.runtime.diffusion.requests import Denoising

# Greedy rows (temperature 0) divide their logits by this: their softmax is their argmax's
# one-hot, their entropies 0, so every position takes its argmax.
_GREEDY_SCALE = 1e-6


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
    """A request's denoising settings and generator; starts its canvases of `length` ids over
    `vocab`."""

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
        return Canvas(self.uniform(), self.settings.steps)

    def scale(self, canvas: Canvas) -> float:
        """The temperature of the canvas's next step."""
        t = self.settings.scale(canvas.left)
        return _GREEDY_SCALE if t == 0 else t

    def uniform(self) -> torch.Tensor:
        return torch.randint(
            0,
            self.vocab,
            (1, self.length),
            generator=self.generator,
            device=self.generator.device,
        )

    def stable(self, canvas: Canvas, argmax: torch.Tensor) -> torch.Tensor:
        """Whether `argmax` [1, L] equals each of the last `stability_threshold` ones (a bool
        on the device; recorded)."""
        n = self.settings.stability_threshold
        if n == 0:
            return torch.ones((), dtype=torch.bool, device=argmax.device)
        if canvas.history is None:
            canvas.history = torch.full(
                (n, *argmax.shape), -1, dtype=argmax.dtype, device=argmax.device
            )
        stable = (canvas.history == argmax[None]).all()
        canvas.history = torch.roll(canvas.history, shifts=-1, dims=0)
        canvas.history[-1] = argmax
        return stable


def denoise(
    rows: Sequence[tuple[CanvasSampler, Canvas]],
    logits: torch.Tensor,
    soft: Callable[[torch.Tensor], torch.Tensor],
) -> list[bool]:
    """Take the denoiser's float32 `logits` [R, L, V] of each row's canvas in: sample, accept
    the positions each row's entropy bound allows, redraw the others, keep the argmax and the
    self-conditioning (`soft` of the scaled logits); which canvases are done (settled, or out
    of steps)."""
    # Each row's temperature, entropy bound and confidence threshold: one copy to the device.
    settings = torch.tensor(
        [(s.scale(c), s.settings.entropy_bound, s.settings.confidence_threshold) for s, c in rows],
        device=logits.device,
    )
    scaled = logits / settings[:, 0, None, None]
    probs = torch.softmax(scaled, dim=-1, dtype=torch.float32)
    sampled = torch.stack(
        [
            torch.multinomial(p, 1, generator=s.generator).view(1, -1)
            for (s, _), p in zip(rows, probs, strict=True)
        ]
    )  # [R, 1, L]
    noise = torch.stack([s.uniform() for s, _ in rows])
    argmax = scaled.argmax(-1)[:, None]  # [R, 1, L]
    entropy = torch.distributions.Categorical(logits=scaled).entropy()  # [R, L]
    ordered, order = torch.sort(entropy, dim=-1)
    accepted = torch.cumsum(ordered, dim=-1) - ordered <= settings[:, 1, None]
    keep = torch.zeros_like(accepted).scatter(-1, order, accepted)[:, None]  # [R, 1, L]
    ids = torch.stack([c.ids for _, c in rows])
    ids = torch.where(~keep, noise, torch.where(keep, sampled, ids))
    conditioning = soft(scaled.flatten(0, 1)).view(len(rows), scaled.shape[1], -1)
    confident = entropy.mean(-1) < settings[:, 2]
    stable = torch.stack([s.stable(c, a) for (s, c), a in zip(rows, argmax, strict=True)])
    settled = (confident & stable).tolist()
    done = []
    for r, (_, canvas) in enumerate(rows):
        canvas.ids, canvas.argmax, canvas.soft = ids[r], argmax[r], conditioning[r]
        canvas.left -= 1
        done.append(canvas.left == 0 or settled[r])
    return done
