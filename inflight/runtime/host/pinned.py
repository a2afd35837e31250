"""`PinnedPrefixes`: the per-row feature of `save_system_prompt_kv_cache` (torch-free).

A request asking for it is served as any other, and its system prompt's full blocks (a chat's
tokens through its system turn, `system_prompt_tokens`; a raw prompt's whole) are pinned in the
context cache once it ends (`ContextCache.pin`): while it runs, it holds them itself. Admission
reserves its blocks against the bound on pinned blocks, so that an admitted request's pin fits;
a request whose pin cannot fit beside the pins held or being made is refused when checked,
naming how to make room (one that passed its check while another pin took the room meanwhile
is served and not pinned, with a warning). A prefix pinned already takes no more room.
"""

from __future__ import annotations

import logging

from inflight.protocol.request import GenerationRequest
from inflight.runtime.host.context_cache import (
    ContextCache,
    prefix_digests,
    prefix_id,
    root_digest,
)
from inflight.runtime.host.features import RowFeature
from inflight.runtime.host.residents import Resident

log = logging.getLogger(__name__)

# How the bound is named to the caller.
BOUND = "max_pinned_prefix_tokens (--max-pinned-prefix-tokens)"


def system_prompt_blocks(request: GenerationRequest, block_size: int) -> int:
    """The full blocks of the request's system prompt: those it pins."""
    prompt = len(request.prompt_token_ids)
    tokens = request.system_prompt_tokens
    return min(prompt if tokens is None else tokens, prompt) // block_size


def pin_id(request: GenerationRequest, block_size: int) -> str:
    """The id the pin of the request's system prompt has (`PinnedPrefix.id`)."""
    *_, last = prefix_digests(
        request.prompt_token_ids,
        system_prompt_blocks(request, block_size),
        block_size,
        root_digest(request.lora_name),
        request.media,
    )
    return prefix_id(last)


class PinnedPrefixes(RowFeature):
    def __init__(self, cache: ContextCache) -> None:
        self.cache = cache
        self.block_size = cache.pool.block_size
        self.reserved = 0  # blocks admitted requests will pin

    def check(self, request: GenerationRequest) -> None:
        if not request.save_system_prompt_kv_cache:
            return
        blocks = system_prompt_blocks(request, self.block_size)
        if blocks == 0:
            raise ValueError(
                "save_system_prompt_kv_cache: the system prompt is shorter than one KV block "
                f"({self.block_size} tokens); there is nothing to pin"
            )
        bs, bound = self.block_size, self.cache.max_pinned_blocks
        if blocks > bound:
            raise ValueError(
                f"save_system_prompt_kv_cache: the system prompt's {blocks * bs} tokens exceed "
                f"{BOUND}, {bound * bs} tokens"
            )
        held = self.cache.pinned_blocks + self.reserved
        if not self._pinned(request) and held + blocks > bound:
            raise ValueError(
                f"save_system_prompt_kv_cache: pinning this system prompt's {blocks * bs} "
                f"tokens would pass {BOUND}, {bound * bs} tokens ({held * bs} pinned or being "
                "pinned); unpin a prefix (LLM.unpin, DELETE /v1/pinned_prefixes/{id}) or raise "
                "the bound"
            )

    def reserve(self, request: GenerationRequest, sequences: int) -> object | None:
        if not request.save_system_prompt_kv_cache or self._pinned(request):
            return 0
        blocks = system_prompt_blocks(request, self.block_size)
        if self.cache.pinned_blocks + self.reserved + blocks > self.cache.max_pinned_blocks:
            # Pins admitted since its check took the room: it is served, and not pinned.
            log.warning("a system prompt of %d blocks is not pinned: the bound is reached", blocks)
            return 0
        self.reserved += blocks
        return blocks

    def unreserve(self, request: GenerationRequest, sequences: int, held: object) -> None:
        assert isinstance(held, int)
        self.reserved -= held

    def seat(self, resident: Resident, held: object) -> None:
        # The first sequence computes the prompt, and pins it.
        if resident.index == 0:
            assert isinstance(held, int)
            resident.features.pin_blocks = held

    def evict(self, resident: Resident) -> None:
        blocks = resident.features.pin_blocks
        if not blocks:
            return
        resident.features.pin_blocks = 0
        self.reserved -= blocks
        digests = resident.kv.digests[:blocks]
        if len(digests) == blocks:  # its prompt was computed (not cancelled before)
            self.cache.pin(digests)

    def _pinned(self, request: GenerationRequest) -> bool:
        """Whether the request's system prompt is pinned already (it then takes no room)."""
        return self.cache.is_pinned(pin_id(request, self.block_size))
