"""Counters of speculative decoding: how many drafts were proposed and how many the target kept,
in all and at each draft position (vLLM's `spec_decode_num_accepted_tokens_per_pos`)."""

from __future__ import annotations

from dataclasses import dataclass, field

# Stats keys of the per-position counts: `ACCEPTED_AT` + the position (0: a draft's first token).
ACCEPTED_AT = "spec_decode_accepted_at:"


@dataclass(slots=True)
class SpecDecodingStats:
    num_drafts: int = 0  # verification steps of a request that had at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # drafts whose token at position i was kept

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        if num_draft_tokens == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        if len(self.accepted_per_pos) < num_accepted_tokens:
            self.accepted_per_pos.extend([0] * (num_accepted_tokens - len(self.accepted_per_pos)))
        for pos in range(num_accepted_tokens):  # the accepted tokens are a prefix of the draft
            self.accepted_per_pos[pos] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens produced per verification step (accepted drafts plus the one sampled token)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def as_dict(self) -> dict[str, float]:
        return {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_acceptance_rate": self.acceptance_rate,
            "spec_decode_mean_acceptance_length": self.mean_acceptance_length,
        } | {f"{ACCEPTED_AT}{pos}": count for pos, count in enumerate(self.accepted_per_pos)}


def accepted_per_pos(stats: dict[str, float]) -> list[float]:
    """The per-position accepted counts of a stats dict, position 0 first."""
    counts = {int(key[len(ACCEPTED_AT):]): value for key, value in stats.items() if key.startswith(ACCEPTED_AT)}
    return [counts.get(pos, 0.0) for pos in range(max(counts) + 1)] if counts else []
