"""The code predictor's micro-loop as CUDA graphs.

Eagerly, each of a frame's codebooks after the first is some 400 small kernels (five decoder
layers on one position, the head, the pick), each launched from Python: on a GPU the launches
cost more than the work, tens of milliseconds a frame. The whole loop has fixed shapes for a
given number of rows, so it is captured once per batch size (rows padded up to the next of the
decode graphs' sizes: `graph_buckets`) and replayed; its inputs, settings and noise are copied
into the graph's buffers first.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from inflight.model.speech.code_predictor import CodePicker
from inflight.runtime.device.cuda_graphs import graph_buckets, pick_bucket
from inflight.runtime.speech.sampling import RowSampling, pick_rows


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    hidden: torch.Tensor  # [size, hidden]
    firsts: torch.Tensor  # [size]
    sampling: RowSampling
    noise: torch.Tensor  # [size, codebooks, vocab]
    frames: torch.Tensor  # [size, groups]
    embeds: torch.Tensor  # [size, hidden]


# A talker's `predict_codes`: (last hidden states, first codes, picker) -> (frames, embeddings).
Predict = Callable[[torch.Tensor, torch.Tensor, CodePicker], tuple[torch.Tensor, torch.Tensor]]


class PredictorGraphs:
    """`predict` captured for rows of `hidden_size` (`dtype`) hidden states, frames of
    `groups` codebooks of `vocab` codes after the first."""

    def __init__(
        self,
        predict: Predict,
        hidden_size: int,
        dtype: torch.dtype,
        groups: int,
        vocab: int,
        max_rows: int,
        device: torch.device,
    ) -> None:
        self.predict = predict
        self.hidden_size, self.dtype = hidden_size, dtype
        self.vocab, self.picks = vocab, groups - 1
        self.device = device
        self.sizes = graph_buckets(max_rows)
        self.pool = torch.cuda.graph_pool_handle()
        self.captured: dict[int, _Captured] = {}

    def run(
        self,
        hidden: torch.Tensor,
        firsts: torch.Tensor,
        sampling: RowSampling,
        noise: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`predict` for these rows, replayed."""
        rows = hidden.shape[0]
        size = pick_bucket(self.sizes, rows)
        assert size is not None  # a step holds at most max_rows rows
        c = self.captured.get(size) or self._capture(size)
        c.hidden[:rows].copy_(hidden)
        c.firsts[:rows].copy_(firsts)
        c.sampling.copy_(sampling)
        if noise is None:
            c.noise[:rows].fill_(1.0)
        else:
            c.noise[:rows].copy_(noise)
        c.graph.replay()
        return c.frames[:rows].clone(), c.embeds[:rows].clone()

    @torch.inference_mode()
    def _capture(self, size: int) -> _Captured:
        device, vocab, picks = self.device, self.vocab, self.picks
        hidden = torch.zeros(size, self.hidden_size, dtype=self.dtype, device=device)
        firsts = torch.zeros(size, dtype=torch.long, device=device)
        sampling = RowSampling(
            torch.ones(size, device=device),
            torch.ones(size, device=device),
            torch.full((size,), vocab, dtype=torch.long, device=device),
            torch.ones(size, dtype=torch.bool, device=device),
        )
        noise = torch.ones(size, picks, vocab, device=device)

        def loop() -> tuple[torch.Tensor, torch.Tensor]:
            return self.predict(
                hidden, firsts, lambda g, logits: pick_rows(logits, sampling, noise[:, g])
            )

        # Warm up off the capture (lazy initialisations must not land in the graph).
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            loop()
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            frames, embeds = loop()
        captured = _Captured(graph, hidden, firsts, sampling, noise, frames, embeds)
        self.captured[size] = captured
        return captured
