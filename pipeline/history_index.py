"""Per-message facts of a conversation, built incrementally.

A stateless client resends its whole history every turn, and what ctxgate computes per
message (its fingerprint, the prefix hash ending at it, its token count) is the same every
time it sees that message. A `HistoryIndex` holds those facts for one conversation;
`extend` computes them only for the messages past a prefix already indexed, so a turn
whose history was seen costs O(new messages).

Hashing is cheap and counting is not (tokenizing is ~50x slower than hashing): `extend`
can leave the new messages uncounted, and `counted` counts them later, e.g. in a thread
beside the upstream call.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .fingerprint import EMPTY_PREFIX, extend_prefix, message_fingerprint
from .tokens import REPLY_PRIMING, TokenCounter

Message = dict[str, Any]


@dataclass(frozen=True)
class HistoryIndex:
    fingerprints: list[str]
    prefix_hashes: list[str]
    """`[i]` names the first i + 1 messages."""
    cumulative_tokens: list[int]
    """`[i]` is the token count of the first i messages (no reply priming): one more entry than
    messages once counted, fewer while the newest are still uncounted."""
    counter_name: str
    """The tokenizer the counts are in."""

    @classmethod
    def build(cls, messages: list[Message], counter: TokenCounter) -> "HistoryIndex":
        return cls([], [], [0], counter.name).extend(messages, 0, counter)

    def __len__(self) -> int:
        return len(self.fingerprints)

    @property
    def is_counted(self) -> bool:
        return len(self.cumulative_tokens) == len(self.fingerprints) + 1

    def extend(self, messages: list[Message], known: int, counter: TokenCounter, count: bool = True) -> "HistoryIndex":
        """The index of `messages`, whose first `known` messages are this index's first ones;
        `count=False` leaves the new ones uncounted (see `counted`)."""
        if counter.name != self.counter_name or known > len(self) or known >= len(self.cumulative_tokens):
            known = 0
        fps = self.fingerprints[:known]
        hashes = self.prefix_hashes[:known]
        h = hashes[-1] if hashes else EMPTY_PREFIX
        for m in messages[known:]:
            fp = message_fingerprint(m)
            h = extend_prefix(h, fp)
            fps.append(fp)
            hashes.append(h)
        index = HistoryIndex(fps, hashes, self.cumulative_tokens[:known + 1], counter.name)
        return index.counted(messages, counter) if count else index

    def counted(self, messages: list[Message], counter: TokenCounter) -> "HistoryIndex":
        """This index with every message counted (`messages` are the ones it indexes)."""
        start = len(self.cumulative_tokens) - 1
        return self.with_counts([counter.count_structured(messages[i], self.fingerprints[i])
                                 for i in range(start, len(self.fingerprints))])

    def with_counts(self, counts: list[int]) -> "HistoryIndex":
        """This index with the uncounted messages' counts, in order, added."""
        totals = list(self.cumulative_tokens)
        total = totals[-1]
        for n in counts:
            total += n
            totals.append(total)
        return HistoryIndex(self.fingerprints, self.prefix_hashes, totals, self.counter_name)

    def head(self, n: int) -> "HistoryIndex":
        """The index of the first `n` messages."""
        return HistoryIndex(self.fingerprints[:n], self.prefix_hashes[:n], self.cumulative_tokens[:n + 1],
                            self.counter_name)

    def tokens(self, start: int = 0) -> int:
        """The count of the messages from `start` on, as `TokenCounter.count_messages` gives it."""
        assert self.is_counted, "an index is counted before its counts are read"
        return self.cumulative_tokens[-1] - self.cumulative_tokens[start] + REPLY_PRIMING
