"""The draft-model drafter: a smaller checkpoint of the target's vocabulary proposes each row's
drafts greedily.

Its KV lives in the target's blocks (the same block ids, its own cache tensors): a resident's
block table serves both, and its reservation covers every position the draft writes (the last
token and the drafts but the last). `SpeculativeState.draft_computed` counts the tokens of the
sequence in the draft's KV. For a step, the draft first catches up on the row's tokens it has
not seen (the prompt at first, then the tokens the last step emitted) and drafts one token from
the last; each further draft is one more single-token forward over the rows still drafting.
After verification only the accepted drafts stay (`rewind`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from inflight.runtime.device.batch_builder import RowInput, build_ragged_batch
from inflight.runtime.device.model_runner import ModelRunner
from inflight.runtime.host.residents import Resident
from inflight.runtime.host.speculative import speculative_state


class DraftModel:
    ahead = False  # it drafts from tokens it has computed

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner  # eager: its steps are few and small

    def propose(self, rows: Sequence[tuple[Resident, int]]) -> list[tuple[int, ...]]:
        drafts: list[list[int]] = [[] for _ in rows]
        # Catch up (and draft the first token) for every row asking for drafts.
        live = [(i, r, k) for i, (r, k) in enumerate(rows) if k > 0]
        if not live:
            return [() for _ in rows]
        inputs = []
        for _, r, _ in live:
            seen = speculative_state(r).draft_computed
            inputs.append(RowInput(r.tokens(seen), seen, r.kv.table, True))
        picks = self._greedy(inputs)
        for (i, r, _), pick in zip(live, picks, strict=True):
            speculative_state(r).draft_computed = r.prompt_len + len(r.output)
            drafts[i].append(pick)
        for step in range(1, max(k for _, _, k in live)):
            live = [(i, r, k) for i, r, k in live if k > step]
            inputs = [
                RowInput((drafts[i][-1],), speculative_state(r).draft_computed, r.kv.table, True)
                for i, r, _ in live
            ]
            for (i, r, _), pick in zip(live, self._greedy(inputs), strict=True):
                speculative_state(r).draft_computed += 1
                drafts[i].append(pick)
        return [tuple(d) for d in drafts]

    def rewind(self, r: Resident, valid: int) -> None:
        state = speculative_state(r)
        state.draft_computed = min(state.draft_computed, valid)

    @torch.inference_mode()
    def _greedy(self, rows: list[RowInput]) -> list[int]:
        """The draft's argmax after each row's last token, the rows run as one step."""
        # Rows of one token first, as a batch wants them.
        order = sorted(range(len(rows)), key=lambda i: len(rows[i].token_ids) > 1)
        runner = self.runner
        batch = build_ragged_batch([rows[i] for i in order], runner.block_size, runner.device)
        tokens = runner.logits(runner.execute(batch)).argmax(dim=-1).tolist()
        picks = [0] * len(rows)
        for slot, i in enumerate(order):
            picks[i] = tokens[slot]
        return picks
