"""Per-row features as hooks (torch-free): what a feature a request may use (an adapter, a
constraint, media) checks at admission, reserves, keeps on each resident and does with each
token the resident accepts. The scheduler and the output processor loop over the features a
runtime serves instead of branching on each; how a feature plans its rows lives in
`decoding.py` and `speculative.py`, what it adds to a forward pass in `device/inputs.py`.
"""

from __future__ import annotations

from inflight.protocol.outputs import FinishReason
from inflight.protocol.request import GenerationRequest
from inflight.runtime.host.residents import Resident


class RowFailure(Exception):
    """A feature cannot go on with one resident: its request fails, naming why, and the rest
    of the step goes on."""


class RowFeature:
    """A feature's part in admission and in taking tokens in; every hook does nothing unless
    the feature says otherwise."""

    def check(self, request: GenerationRequest) -> None:
        """Raise a ValueError naming the problem where the request uses the feature in a way
        this runtime cannot serve. Any thread may call it."""

    def reads_prompt(self, request: GenerationRequest) -> bool:
        """Whether the feature reads what the prefill computes at the request's prompt
        positions (then no cached prefix stands in for them)."""
        return False

    def reserve(self, request: GenerationRequest, sequences: int) -> object | None:
        """Take what `sequences` new residents of `request` need of the feature: what they will
        hold (handed to `seat`), or None, having taken nothing, when it has no room for them now
        (the request waits). A ValueError when the request can no longer be served at all."""
        return True

    def unreserve(self, request: GenerationRequest, sequences: int, held: object) -> None:
        """Give back what `reserve` took, for an admission that did not complete."""

    def seat(self, resident: Resident, held: object) -> None:
        """Give a newly seated resident its state (`held`: what `reserve` took for it)."""

    def evict(self, resident: Resident) -> None:
        """Give back what an evicted resident held."""

    def keeps(
        self, resident: Resident, reason: FinishReason, stop_reason: str | int | None
    ) -> bool:
        """Whether a resident whose output just ended (`reason`: stop or length) stays seated
        for the feature, its request not over (a reply still being spoken): the feature ends
        it later. Asked once per resident."""
        return False

    def accept(self, resident: Resident, token: int) -> FinishReason | None:
        """Take one output token of the resident in: why it ends there, or None (RowFailure
        where the resident cannot go on)."""
        return None
