"""Per-row sampling: every row of a step carries its own parameters.

Logit bias (and, below a row's `min_tokens`, its ending tokens ruled out), then penalties
(repetition over the prompt and output so far, frequency and presence over the output, vLLM's
formulas and order), then a structured-outputs mask shape what every row may pick. Greedy rows
take the argmax. Sampled rows apply temperature, top-k, top-p and min-p, then draw by inverting
their cumulative distribution at one uniform number each (one random number a row, where racing
exponential noise drew one per token of the vocabulary: on the CPU that noise took more time
than a decode step of the default model). A row with a seed draws its number from a generator
seeded by (seed, output position, sequence of its request) alone, so it picks the same tokens
whatever else shares the step. Log-probabilities are those of the raw distribution.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from inflight.model.kernels.cpu import ops as cpu_ops
from inflight.model.transfer import to_device
from inflight.runtime.host.rows import SampledRow, SamplingRow

_SEED_STRIDE = 1_000_003  # mixes (seed, position, sequence) into one generator seed
_SEQUENCE_STRIDE = 7_919_003_233  # past any position: sequence i's draws are its own


@dataclass
class Sampled:
    """One step's picks: `tokens` stay on the device (the next step may read them there); the
    host copies are complete once `ready` has fired."""

    tokens: torch.Tensor
    host: list[torch.Tensor | None]  # tokens, chosen logprobs, top values, top ids
    wanted: list[int]  # rows that asked for logprobs
    top_n: list[int]
    ready: torch.cuda.Event | None


def _to_host(tensor: torch.Tensor | None) -> torch.Tensor | None:
    if tensor is None or tensor.device.type == "cpu":
        return tensor
    return tensor.to("cpu", non_blocking=True)


def _event(device: torch.device) -> torch.cuda.Event | None:
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def seeded_generator(device: torch.device, seed: int | None) -> torch.Generator:
    """A generator on `device` seeded by the deployment's `seed` (None: from the OS)."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


class Sampler:
    def __init__(
        self,
        seed: int | None = None,
        device: torch.device | None = None,
        eos: Sequence[int] = (),
    ) -> None:
        device = device or torch.device("cpu")
        self._eos = tuple(eos)  # what `min_tokens` rules out, beside a row's stop token ids
        self._generator = seeded_generator(device, seed)
        self._apply_masks = select_mask_kernel(device)
        self._argmax = select_argmax(device)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[SampledRow]:
        return self.fetch(self.sample(logits, rows))

    @torch.no_grad()
    def sample(
        self,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        masks: tuple[list[int], torch.Tensor] | None = None,
    ) -> Sampled:
        """Pick every row's token on the device, and start copying the results to the host.

        `masks`: the rows under a structured-outputs constraint and the packed int32 bitmask
        [rows, ceil(vocab / 32)] of the tokens each may take (bit i of word j: token 32 j + i).
        They are masked after bias and penalties, before sampling's filters; logprobs stay
        those of the raw logits."""
        banned = _min_tokens_bans(rows, self._eos)
        edited = (
            masks is not None
            or bool(banned)
            or any(r.params.logit_bias or r.params.penalized for r in rows)
        )
        if not edited and all(_argmax_only(r) for r in rows):
            # A widening is exact, so the argmax of the model's bf16 logits is their float32
            # copy's: on CUDA the copy (a read and two writes of every logit) is not made (the
            # CPU's native argmax reads float32).
            tokens = self._argmax(logits if logits.is_cuda else logits.float())
            host: list[torch.Tensor | None] = [_to_host(tokens), None, None, None]
            return Sampled(tokens, host, wanted=[], top_n=[], ready=_event(logits.device))
        logits = logits.float()
        biased = logits
        # One copy for bias, penalties and masks to write: the raw logits give the logprobs.
        if edited:
            biased = logits.clone()
            _apply_bias(biased, rows, banned)
            _apply_penalties(biased, rows)
        if masks is not None:
            masked, packed = masks
            self._apply_masks(biased, to_device(masked, torch.int64, logits.device), packed)
        tokens = self._argmax(biased)
        drawn = [i for i, r in enumerate(rows) if not r.params.greedy]
        if drawn:
            index = to_device(drawn, torch.int64, logits.device)
            tokens[index] = self._draw(biased[index], [rows[i] for i in drawn])
        wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        top_n = [rows[i].params.logprobs for i in wanted]
        chosen = top_values = top_ids = None
        if wanted:
            index = to_device(wanted, torch.int64, logits.device)
            logprobs = torch.log_softmax(logits[index], dim=-1)
            chosen = logprobs.gather(1, tokens[index].unsqueeze(1)).squeeze(1)
            if max(top_n):
                top_values, top_ids = logprobs.topk(max(top_n), dim=-1)
        return Sampled(
            tokens=tokens,
            host=[_to_host(t) for t in (tokens, chosen, top_values, top_ids)],
            wanted=wanted,
            top_n=top_n,
            ready=_event(logits.device),
        )

    @staticmethod
    def fetch(sampled: Sampled) -> list[SampledRow]:
        """The sampled rows on the host (waits for the device)."""
        if sampled.ready is not None:
            sampled.ready.synchronize()
        tokens, chosen, top_values, top_ids = (
            None if t is None else t.tolist() for t in sampled.host
        )
        out = [SampledRow(token_id=t) for t in tokens]
        for j, (i, n) in enumerate(zip(sampled.wanted, sampled.top_n, strict=True)):
            out[i].logprob = chosen[j]
            out[i].top_ids = top_ids[j][:n] if n else []
            out[i].top_logprobs = top_values[j][:n] if n else []
        return out

    @torch.no_grad()
    def score(self, logits: torch.Tensor, targets: Sequence[int], top_n: int) -> list[SampledRow]:
        """The log-probability of each given next token, and the top_n alternatives."""
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        chosen = logprobs.gather(1, torch.tensor(targets, device=logits.device)[:, None])
        chosen_host = chosen.squeeze(1).tolist()
        if top_n:
            values, ids = logprobs.topk(top_n, dim=-1)
            values_host, ids_host = values.tolist(), ids.tolist()
        else:
            values_host = ids_host = [[] for _ in targets]
        return [
            SampledRow(token, lp, top_ids, top_lps)
            for token, lp, top_ids, top_lps in zip(
                targets, chosen_host, ids_host, values_host, strict=True
            )
        ]

    def _draw(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Each row's draw; `logits` (the sampled rows' copy) are scaled in place."""
        device = logits.device
        temperature = to_device([r.params.temperature for r in rows], torch.float32, device)
        scaled = logits.div_(temperature.unsqueeze(1))
        top_k = [r.params.top_k for r in rows]
        top_p = [r.params.top_p for r in rows]
        min_p = [r.params.min_p for r in rows]
        if any(k > 0 for k in top_k) or any(p < 1 for p in top_p) or any(p > 0 for p in min_p):
            scaled = _filter(scaled, top_k, top_p, min_p)
        uniform = torch.rand(
            len(rows), dtype=torch.float64, device=device, generator=self._generator
        )
        for i, row in enumerate(rows):
            if row.params.seed is not None:
                generator = torch.Generator(device=device)
                mixed = row.params.seed * _SEED_STRIDE + row.position
                generator.manual_seed((mixed + row.sequence * _SEQUENCE_STRIDE) % (2**63))
                uniform[i] = torch.rand((), dtype=torch.float64, device=device, generator=generator)
        return _invert(scaled, uniform)


# Tokens a block of the cumulative sum (below).
_BLOCK = 256


def _invert(scaled: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Each row's token where its cumulative distribution (of softmax(scaled)) first passes
    its number in [0, 1) times the row's mass: a draw from that distribution. The sum runs in
    float64 over blocks of `_BLOCK` tokens, then within the block it lands in (a float64 sum
    over the whole vocabulary cost 4 ms on the CPU for 16 rows of 49,152; a float32 one drifts
    by up to vocab x 2^-24). A token of probability 0 (masked, filtered, or underflowing float32
    as softmax's does) is never picked."""
    probs = torch.softmax(scaled, dim=-1)
    rows, vocab = probs.shape
    blocks = -(-vocab // _BLOCK)
    if vocab % _BLOCK:
        probs = torch.nn.functional.pad(probs, (0, blocks * _BLOCK - vocab))
    tiled = probs.view(rows, blocks, _BLOCK)
    # Each block's sum in float32 (pairwise: within a few ulps), the running sum in float64.
    mass = tiled.sum(dim=-1).double()
    ends = mass.cumsum(dim=-1)
    total = ends[:, -1:]
    # Strictly below the total, so that some block's sum passes it.
    target = torch.minimum(
        uniform.unsqueeze(1) * total, torch.nextafter(total, total.new_zeros(()))
    )
    block = torch.searchsorted(ends, target, right=True).clamp_(max=blocks - 1)
    within = tiled[torch.arange(rows, device=probs.device), block.squeeze(1)]
    sums = (ends.gather(1, block) - mass.gather(1, block)) + within.cumsum(-1, dtype=torch.float64)
    picked = torch.searchsorted(sums, target, right=True).squeeze(1)
    # The block's own sum may round below its share of `ends`: then its last token that can be
    # picked at all.
    positions = torch.arange(_BLOCK, device=probs.device)
    last = torch.where(within > 0, positions, -1).amax(dim=-1)
    picked = torch.where(picked >= _BLOCK, last, picked)
    return (block.squeeze(1) * _BLOCK + picked).clamp_(0, vocab - 1)


def _min_tokens_bans(rows: list[SamplingRow], eos: tuple[int, ...]) -> list[tuple[int, int]]:
    """(row, token) for the tokens that would end a row drawing below its `min_tokens`: its
    stop token ids, and EOS unless it ignores EOS."""
    bans = []
    for i, r in enumerate(rows):
        params = r.params
        if r.position < params.min_tokens:
            ending = params.stop_token_ids if params.ignore_eos else (*eos, *params.stop_token_ids)
            bans += [(i, t) for t in ending]
    return bans


def _apply_bias(
    logits: torch.Tensor, rows: list[SamplingRow], banned: Sequence[tuple[int, int]] = ()
) -> None:
    """In place: each row's logit bias, and -inf for its `banned` tokens."""
    entries = [(i, t, b) for i, r in enumerate(rows) for t, b in r.params.logit_bias.items()]
    entries += [(i, t, -math.inf) for i, t in banned]
    if not entries:
        return
    row_ids, token_ids, biases = zip(*entries, strict=True)
    device = logits.device
    logits.index_put_(
        (to_device(row_ids, torch.int64, device), to_device(token_ids, torch.int64, device)),
        to_device(biases, logits.dtype, device),
        accumulate=True,
    )


def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """In place: the penalized rows' penalties, as vLLM applies them, repetition first, then
    frequency and presence. Only the tokens a row has seen change, so only those are read and
    written."""
    penalized, seen_ids, counts, penalties = [], [], [], []
    for i, row in enumerate(rows):
        params = row.params
        if not params.penalized:
            continue
        output = np.asarray(row.output, dtype=np.int64)
        seen = np.union1d(np.asarray(row.prompt, dtype=np.int64), output)
        counted, times = np.unique(output, return_counts=True)
        count = np.zeros(len(seen), dtype=np.float32)
        count[np.searchsorted(seen, counted)] = times
        penalized.append(i)
        seen_ids.append(seen)
        counts.append(count)
        penalties.append(
            (params.repetition_penalty, params.frequency_penalty, params.presence_penalty)
        )
    lengths = [len(seen) for seen in seen_ids]
    if not sum(lengths):
        return
    device = logits.device
    at = (
        to_device(np.repeat(penalized, lengths), torch.int64, device),
        to_device(np.concatenate(seen_ids), torch.int64, device),
    )
    per_token = np.repeat(np.asarray(penalties, dtype=np.float32), lengths, axis=0)
    repetition, frequency, presence = to_device(per_token, torch.float32, device).unbind(1)
    count = to_device(np.concatenate(counts), torch.float32, device)
    values = logits[at]
    values = torch.where(values > 0, values / repetition, values * repetition)
    logits[at] = values - frequency * count - presence * (count > 0)


MaskKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


def torch_apply_masks(logits: torch.Tensor, rows: torch.Tensor, packed: torch.Tensor) -> None:
    """In place: the logits of `rows` that their bitmask rows do not allow become -inf."""
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    blocked = ((packed.unsqueeze(-1) >> shifts) & 1 == 0).flatten(1)[:, : logits.shape[-1]]
    logits[rows] = logits[rows].masked_fill(blocked, float("-inf"))


def select_mask_kernel(device: torch.device) -> MaskKernel:
    """The native kernel on the CPU where it builds (a tenth of the torch formula's time at
    batch 16 over a 49k vocabulary), else the torch formula."""
    lib = cpu_ops.library() if device.type == "cpu" else None
    return torch_apply_masks if lib is None else functools.partial(cpu_ops.apply_token_bitmask, lib)


def select_argmax(device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    """Each row's argmax: the native kernel on the CPU where it builds (0.06 ms over 16 x 49,152
    logits where torch's took 0.37-0.47, 2-3 % of a SmolLM2 decode step), else torch's."""
    lib = cpu_ops.library() if device.type == "cpu" else None
    if lib is None:
        return functools.partial(torch.argmax, dim=-1)
    return functools.partial(cpu_ops.argmax, lib)


# Top-k and top-p look among each row's most likely tokens, at least this many, then 16 times
# as many where a nucleus reaches past them, up to the whole row: a sort of a whole vocabulary
# cost more than a CPU decode step (28 ms for 16 rows of 49,152), the 64 likeliest 0.8 ms.
_CANDIDATES = 64


def _filter(
    logits: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float]
) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k, top-p nucleus and min-p floor: the k most
    likely; then, with probabilities renormalized over those, each token while the mass of the
    tokens more likely than it is below top_p; and each at least min_p times the likeliest."""
    device = logits.device
    rows, vocab = logits.shape
    k = [v if 0 < v < vocab else vocab for v in top_k]
    keep = torch.ones_like(logits, dtype=torch.bool)
    # Each row's look starts at a width of its own (so that what it keeps never depends on
    # what shares its step): its top k, at least `_CANDIDATES`. On a GPU a nucleus without
    # top-k is looked for in the whole row at once: reading back which rows reach past their
    # candidates would hold the host until the step's forward is done, where it is preparing
    # the next step.
    on_cpu = logits.device.type == "cpu"

    def first_width(i: int) -> int:
        if k[i] < vocab:
            return min(vocab, max(_CANDIDATES, k[i]))
        return min(vocab, _CANDIDATES) if on_cpu else vocab

    widths = {i: first_width(i) for i in range(rows) if k[i] < vocab or top_p[i] < 1}
    while widths:
        groups: dict[int, list[int]] = {}
        for i, width in widths.items():
            groups.setdefault(width, []).append(i)
        widths = {
            i: min(vocab, width * 16)
            for width, group in groups.items()
            for i in _cut(logits, keep, group, k, top_p, width)
        }
    floor = [i for i in range(rows) if min_p[i] > 0]
    if floor:
        index = to_device(floor, torch.int64, device)
        least = to_device([math.log(min_p[i]) for i in floor], torch.float32, device)
        # p < min_p * p_max, in logits: renormalizing scales every p alike.
        row = logits[index]
        keep[index] &= row >= row.amax(dim=-1, keepdim=True) + least.unsqueeze(1)
    return logits.masked_fill(~keep, float("-inf"))


def _cut(
    logits: torch.Tensor,
    keep: torch.Tensor,
    todo: list[int],
    k: list[int],
    top_p: list[float],
    width: int,
) -> list[int]:
    """`keep` of the rows `todo` from their `width` likeliest tokens (at least their top k);
    the rows whose nucleus reaches past them, left to a wider look."""
    device = logits.device
    vocab = logits.shape[-1]
    index = to_device(todo, torch.int64, device)
    row = logits[index]
    candidates, order = row.topk(width, dim=-1)
    limit = to_device([k[i] for i in todo], torch.int64, device).unsqueeze(1)
    outside = torch.arange(width, device=device).unsqueeze(0) >= limit
    # Renormalized over the top k: over the whole row where k is the vocabulary (a pass over
    # the rows only where one of them has no top-k).
    norm = candidates.masked_fill(outside, float("-inf")).logsumexp(dim=-1, keepdim=True)
    if any(k[i] == vocab for i in todo):
        norm = torch.where(limit < vocab, norm, row.logsumexp(dim=-1, keepdim=True))
    probs = torch.exp(candidates - norm).masked_fill(outside, 0.0)
    before = probs.cumsum(dim=-1) - probs
    nucleus = to_device([top_p[i] for i in todo], torch.float32, device).unsqueeze(1)
    # top_p 1 cuts nothing (a float sum may reach 1 before the last tokens).
    dropped = outside | ((before >= nucleus) & (nucleus < 1))
    dropped[:, 0] = False
    keep[index] = torch.zeros_like(row, dtype=torch.bool).scatter_(1, order, ~dropped)
    if width == vocab or all(k[i] < vocab for i in todo):
        return []
    # Only a nucleus that has not closed among the candidates reaches past them.
    mass = before[:, -1] + probs[:, -1]
    reaches = (limit.squeeze(1) == vocab) & (mass < nucleus.squeeze(1))
    return [todo[j] for j in reaches.nonzero().flatten().tolist()]


def _argmax_only(row: SamplingRow) -> bool:
    """Whether the row's pick is its logits' argmax and nothing else of them is returned."""
    return row.params.greedy and row.params.logprobs is None
