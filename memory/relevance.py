"""Lexical relevance for the file and Redis stores: BM25 over an inverted index.

Written here rather than taken from a package: bm25s needs scipy and rank-bm25 scores
every document on every query; an inverted index touches only the entries that share a
word with the query, which is what a 10,000-entry store needs on the request path.
"""
from __future__ import annotations

import math
import re
from collections import Counter, defaultdict

_WORD = re.compile(r"[a-z0-9_]{2,}|[\u4e00-\u9fff]")
_STOP = frozenset("the and for are but not you your with this that from have has was were will would can "
                  "could should what which when where who how all any our out use used into its it's is in "
                  "on of to a an be by as at or if do does did so than then them they their there here "
                  "please".split())
K1, B = 1.2, 0.75


def words(text: str) -> list[str]:
    return [w for w in _WORD.findall(text.lower()) if w not in _STOP]


class LexicalIndex:
    def __init__(self) -> None:
        self._postings: dict[str, dict[str, int]] = defaultdict(dict)
        self._lengths: dict[str, int] = {}
        self._words: dict[str, list[str]] = {}

    def __len__(self) -> int:
        return len(self._lengths)

    def add(self, doc_id: str, text: str) -> None:
        self.remove(doc_id)
        counts = Counter(words(text))
        self._lengths[doc_id] = sum(counts.values())
        self._words[doc_id] = list(counts)
        for word, n in counts.items():
            self._postings[word][doc_id] = n

    def remove(self, doc_id: str) -> None:
        if self._lengths.pop(doc_id, None) is None:
            return
        for word in self._words.pop(doc_id):
            del self._postings[word][doc_id]
            if not self._postings[word]:
                del self._postings[word]

    def scores(self, query: str) -> dict[str, float]:
        n = len(self._lengths)
        if not n:
            return {}
        mean = sum(self._lengths.values()) / n
        out: dict[str, float] = defaultdict(float)
        for word in set(words(query)):
            docs = self._postings.get(word)
            if not docs:
                continue
            idf = math.log(1 + (n - len(docs) + 0.5) / (len(docs) + 0.5))
            for doc_id, tf in docs.items():
                norm = tf + K1 * (1 - B + B * self._lengths[doc_id] / mean)
                out[doc_id] += idf * tf * (K1 + 1) / norm
        return dict(out)
