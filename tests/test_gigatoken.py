"""gigatoken encodes o200k and cl100k for ctxgate (pipeline/tokens.py, `GigatokenEncoder`): it
must give tiktoken's ids, token for token, for every text a request can carry. Held here to
tiktoken itself on every string of the recorded agent runs, on generated text built from the
characters BPE splitting is most particular about, and on what gigatoken refuses."""
from __future__ import annotations

import random

import pytest
import tiktoken

from clients import strings
from ctxgate.pipeline.tokens import GigatokenEncoder, TiktokenEncoder, TokenizerRegistry, tiktoken_encoder
from trajectories import every_dialect

ENCODINGS = ("o200k_base", "cl100k_base")
PIECES = [*"abcXYZ019 \t\n\r'’\"!?.,;:-_/\\()[]{}<>|@#$%^&*~`éßΩж中文日本語한국어😀\u200b\u00a0\u3000\u0301",
          "🧑‍💻", "'s", "'RE", "'ll", "n't", "<|endoftext|>", "<|im_start|>", "<|fim_prefix|>", "   ", "\n\n",
          " \n ", "123456789", "1,000.5", "0x1F", "    def ", "\r\n", "https://x.io/a?b=c"]


def _recorded() -> list[str]:
    texts = {s for run in every_dialect() for s in strings([run.messages, run.tools])}
    return sorted(texts)


def _generated(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(PIECES) for _ in range(rng.randint(0, 80))) for _ in range(count)]


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_every_recorded_string_gets_tiktokens_ids(encoding: str) -> None:
    ours, theirs = tiktoken_encoder(encoding), tiktoken.get_encoding(encoding)
    assert isinstance(ours, GigatokenEncoder)
    texts = _recorded()
    assert len(texts) > 1000 and sum(map(len, texts)) > 1_000_000
    differ = [t for t in texts if ours.encode(t) != theirs.encode(t, disallowed_special=())]
    assert differ == []
    assert [ours.count(t) for t in texts] == [len(theirs.encode(t, disallowed_special=())) for t in texts]


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_generated_text_gets_tiktokens_ids(encoding: str) -> None:
    ours, theirs = tiktoken_encoder(encoding), tiktoken.get_encoding(encoding)
    texts = _generated(20_000, seed=7) + ["".join(_generated(400, seed=8))]
    differ = [t for t in texts if ours.encode(t) != theirs.encode(t, disallowed_special=())]
    assert differ == []


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_what_gigatoken_refuses_is_encoded_as_tiktoken_does(encoding: str) -> None:
    """A lone surrogate is not UTF-8: tiktoken replaces it, and so the encoder must."""
    ours, theirs = tiktoken_encoder(encoding), tiktoken.get_encoding(encoding)
    for text in ("a\udc80b", "\ud800", "ok \udfff ok " * 50):
        assert ours.encode(text) == theirs.encode(text, disallowed_special=())
        assert ours.count(text) == len(theirs.encode(text, disallowed_special=()))


def test_an_encoding_gigatoken_cannot_load_stays_with_tiktoken() -> None:
    """p50k's BPE file has gaps in its ranks, which gigatoken refuses."""
    encoder = tiktoken_encoder("p50k_base")
    assert type(encoder) is TiktokenEncoder
    counter = TokenizerRegistry().counter("tiktoken:p50k_base")
    text = "def f(x):\n    return x  # p50k"
    assert counter.count(text) == len(tiktoken.get_encoding("p50k_base").encode(text))
