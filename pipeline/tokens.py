"""The tokenCounter: counts with the target model's own tokenizer.

OpenAI models use tiktoken with the BPE files the litellm wheel ships (never downloaded).
Other models use a Hugging Face tokenizer through transformers, from a local
`tokenizer.json` or a local HF cache, chosen by `tokenizers:` rules in the config. A model
with no known tokenizer gets an estimate, a log warning and a metrics count.

Message counts follow OpenAI's published formula: 3 tokens per message, the tokens of
every string field (role, content, name, tool_call_id), 1 more when `name` is set, and 3
to prime the reply; each tool call its name and arguments and 3 more, and what else the
provider reads of a turn (a Responses reasoning item's summary) as an item of its own.
Counts are cached per message fingerprint, so a turn that resends a long history costs
O(new messages).
"""
from __future__ import annotations

import fnmatch
import functools
import hashlib
import importlib.util
import logging
import math
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

import gigatoken
import orjson
import xxhash

from .boundaries import head_at_boundary, tail_at_boundary
from .fingerprint import message_fingerprint, tools_fingerprint
from .types import Message

log = logging.getLogger("ctxgate.tokens")

TOKENS_PER_MESSAGE = 3
TOKENS_PER_NAME = 1
REPLY_PRIMING = 3
TOKENS_PER_TOOL_CALL = 3
TOKENS_PER_TOOL = 8
TOOLS_OVERHEAD = 12
IMAGE_TOKENS = 85
"""OpenAI's fixed cost of a low-detail image: the least an image can cost, and what one is counted at."""
_CACHE_SIZE = 50_000
"""Counts kept by fingerprint (~200 bytes each). A session's own history is counted once in
its `HistoryIndex`; this serves what sessions share (system prompts, tool schemas) and the
compaction levels' recounts."""
_CUTS_SIZE = 1024
"""Cut outputs kept (head and tail, at most a few thousand tokens each)."""


def _litellm_tokenizer_dir() -> Path | None:
    """Where the litellm wheel keeps tiktoken's BPE files, found without importing litellm."""
    spec = importlib.util.find_spec("litellm")
    if spec is None or not spec.origin:
        return None
    path = Path(spec.origin).parent / "litellm_core_utils" / "tokenizers"
    return path if path.is_dir() else None


_BUNDLED = _litellm_tokenizer_dir()
if _BUNDLED is not None:
    # Must be set before tiktoken's first get_encoding, or tiktoken downloads the files.
    os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(_BUNDLED))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import tiktoken  # noqa: E402  (after TIKTOKEN_CACHE_DIR on purpose)
from tiktoken.model import MODEL_PREFIX_TO_ENCODING, MODEL_TO_ENCODING  # noqa: E402

# tiktoken names each cached BPE file by the sha1 of its URL; only these are in the wheel.
_BUNDLED_ENCODINGS = ("o200k_base", "cl100k_base", "p50k_base")
_PRETOKENIZERS = {"o200k_base": "o200k", "cl100k_base": "cl100k"}
"""The encodings gigatoken encodes, with its name for their split rule (a BPE file holds only
the merges; p50k's file has gaps in its ranks, which gigatoken refuses)."""
DEEPSEEK_TOKENIZER = _BUNDLED / "deepseek_tokenizer.json" if _BUNDLED else None


class Encoder(Protocol):
    inline_count_bytes: int
    """A count of a request body up to this many bytes runs on the event loop (a few tenths of
    a millisecond at most), a larger one in a thread, whose hop costs 0.1-5 ms."""

    def encode(self, text: str) -> list[int]: ...

    def count(self, text: str) -> int: ...

    def decode(self, ids: list[int]) -> str: ...

    def longest_token_bytes(self) -> int:
        """The most UTF-8 bytes one token covers: a text of n characters is at least
        n / this many tokens."""
        ...


class TiktokenEncoder:
    """An OpenAI encoding, from the BPE file the litellm wheel ships."""

    inline_count_bytes = 16_384  # ~1 ms of tiktoken

    def __init__(self, encoding: str) -> None:
        self._enc = tiktoken.get_encoding(encoding)

    def encode(self, text: str) -> list[int]:
        return self._enc.encode(text, disallowed_special=())

    def count(self, text: str) -> int:
        # The ids as one array, not a list of Python ints: a count then holds the GIL only
        # briefly (a 36 MB text's 7M-int list held it ~0.5 s, stalling every other request).
        return len(self._enc.encode_to_numpy(text, disallowed_special=()))

    def decode(self, ids: list[int]) -> str:
        return self._enc.decode(ids)

    @functools.cache
    def longest_token_bytes(self) -> int:
        return max(len(token) for token in self._enc.token_byte_values())


class GigatokenEncoder(TiktokenEncoder):
    """An OpenAI encoding that gigatoken knows how to split (o200k, cl100k), encoded by it from
    the same BPE file: tiktoken's ids (tests/test_gigatoken.py holds it to them) in a tenth of
    the time, a new 107K conversation in ~2.5 ms of one core rather than ~25, the GIL released.
    tiktoken decodes, and encodes what gigatoken refuses (a lone surrogate, which tiktoken
    replaces)."""

    inline_count_bytes = 65_536  # ~0.4 ms of gigatoken

    def __init__(self, encoding: str, path: Path) -> None:
        super().__init__(encoding)
        self._fast = gigatoken.Tokenizer.from_tiktoken(path, pretokenizer=_PRETOKENIZERS[encoding])

    def encode(self, text: str) -> list[int]:
        try:
            return self._fast.encode(text).tolist()  # type: ignore[no-any-return]
        except TypeError:  # not valid UTF-8
            return super().encode(text)

    def count(self, text: str) -> int:
        try:
            return len(self._fast.encode(text))
        except TypeError:
            return len(super().encode(text))


def tiktoken_encoder(encoding: str) -> TiktokenEncoder:
    """A bundled encoding's encoder: gigatoken's when it splits that encoding's text."""
    if encoding in _PRETOKENIZERS and _BUNDLED is not None:
        url = f"https://openaipublic.blob.core.windows.net/encodings/{encoding}.tiktoken"
        path = _BUNDLED / hashlib.sha1(url.encode()).hexdigest()  # tiktoken's name for its file
        if path.is_file():
            return GigatokenEncoder(encoding, path)
    return TiktokenEncoder(encoding)


class HuggingFaceEncoder:
    """A transformers fast tokenizer from a local tokenizer.json, directory or HF cache name."""

    inline_count_bytes = 16_384  # ~1 ms of a Rust tokenizer with its Python calls

    def __init__(self, source: str) -> None:
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

        path = Path(source).expanduser()
        if path.is_file():
            tok = PreTrainedTokenizerFast(tokenizer_file=str(path))
        else:
            # Typed as fast-or-SentencePiece; only a fast (Rust-backed) tokenizer has the backend_tokenizer used below.
            tok = AutoTokenizer.from_pretrained(  # type: ignore[assignment]
                str(path) if path.is_dir() else source, local_files_only=True)
        # The Rust tokenizer underneath: same ids, without transformers' per-call overhead.
        self._tok = tok.backend_tokenizer

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def count(self, text: str) -> int:
        return len(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)

    @functools.cache
    def longest_token_bytes(self) -> int:
        # A vocabulary entry's UTF-8 is at least the bytes it stands for (byte-level BPE spells
        # some bytes with two-byte characters; SentencePiece spells a space as one of three).
        return max(len(token.encode()) for token in self._tok.get_vocab(with_added_tokens=True))


class EstimateEncoder:
    """No known tokenizer: ceil(UTF-8 bytes / 3), which over-counts every real BPE on
    English and code (not on runs of digits, which it under-counts by up to half, until the
    provider's usage calibrates the session's count); each 'token' is a 3-byte slice, so
    head/tail cuts still work."""

    inline_count_bytes = 65_536  # a length per message: the messages' walk is the cost

    def encode(self, text: str) -> list[int]:
        return list(range(self.count(text)))

    def count(self, text: str) -> int:
        return math.ceil(len(text.encode()) / 3)

    def decode(self, ids: list[int]) -> str:
        raise NotImplementedError("an estimate cannot decode; use TokenCounter.head/tail")

    def longest_token_bytes(self) -> int:
        return 3


class TokenCounter:
    """Counts text, messages and tool schemas for one tokenizer, with a fingerprint cache."""

    def __init__(self, name: str, encoder: Encoder, exact: bool = True, byte_bounded: bool = False) -> None:
        self.name = name
        self.exact = exact
        self.byte_bounded = byte_bounded
        """Its count of a text is at most the text's UTF-8 bytes (a byte-level BPE: every token
        covers at least one byte; the estimate: a third of them): `json_bound` holds for it."""
        self._encoder = encoder
        self.inline_count_bytes = encoder.inline_count_bytes
        self._cache: OrderedDict[str, int] = OrderedDict()
        self._cuts: OrderedDict[str, tuple[str, str]] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def encode(self, text: str) -> list[int]:
        return self._encoder.encode(text)

    def least(self, characters: int) -> int:
        """At least what a text of this many characters counts, known without reading it."""
        return characters // self._encoder.longest_token_bytes()

    def count(self, text: str) -> int:
        if not text:
            return 0
        return self._encoder.count(text)

    def count_cached(self, text: str) -> int:
        """count(text), kept in the message cache under the text's hash: a long tool output
        is resent every turn, and hashing it is ~100x cheaper than tokenizing it again."""
        key = "text:" + xxhash.xxh3_128_hexdigest(text.encode())
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return cached
        n = self.count(text)
        self._remember(key, n)
        return n

    def _remember(self, key: str, n: int) -> None:
        with self._lock:
            self.misses += 1
            self._cache[key] = n
            if len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)

    def head_and_tail(self, text: str, head: int, tail: int) -> tuple[str, str]:
        """head(text, head) and tail(text, tail) from one encoding of `text`."""
        if not self.exact:
            return self.head(text, head), self.tail(text, tail)
        ids = self._encoder.encode(text)
        return (self._head_within(text, self._decoded_length(ids[:head]) if head > 0 else 0, head),
                self._tail_within(text, self._decoded_length(ids[-tail:]) if tail > 0 else 0, tail))

    def head_and_tail_cached(self, text: str, head: int, tail: int) -> tuple[str, str]:
        """head_and_tail(), kept under the text's hash: Microcompact cuts the same long
        outputs again on every turn, and encoding them is what a cut costs."""
        key = f"{xxhash.xxh3_128_hexdigest(text.encode())}:{head}:{tail}"
        with self._lock:
            cut = self._cuts.get(key)
            if cut is not None:
                self._cuts.move_to_end(key)
                return cut
        cut = self.head_and_tail(text, head, tail)
        with self._lock:
            self._cuts[key] = cut
            if len(self._cuts) > _CUTS_SIZE:
                self._cuts.popitem(last=False)
        return cut

    def head(self, text: str, tokens: int) -> str:
        """The longest start of `text` that is at most `tokens` tokens and ends at a boundary
        (boundaries.py: a line, else a word, else a character; never inside a reference)."""
        if tokens <= 0:
            return ""
        if not self.exact:
            return self._head_within(text, len(text.encode()[: tokens * 3].decode(errors="ignore")), tokens)
        return self._head_within(text, self._decoded_length(self._encoder.encode(text)[:tokens]), tokens)

    def tail(self, text: str, tokens: int) -> str:
        """The longest end of `text` that is at most `tokens` tokens and starts at a boundary."""
        if tokens <= 0:
            return ""
        if not self.exact:
            raw = text.encode()
            return self._tail_within(text, len(raw[max(0, len(raw) - tokens * 3):].decode(errors="ignore")), tokens)
        return self._tail_within(text, self._decoded_length(self._encoder.encode(text)[-tokens:]), tokens)

    def _decoded_length(self, ids: list[int]) -> int:
        """The characters `ids` decode to, less a character a token boundary cut in two (it
        decodes to U+FFFD)."""
        return len(self._encoder.decode(ids).rstrip("\ufffd").lstrip("\ufffd")) if ids else 0

    def _head_within(self, text: str, chars: int, tokens: int) -> str:
        """The start of `text` at a boundary within `chars` characters, backed off while it is
        over `tokens` (a shorter text can tokenise differently at its edge)."""
        out = head_at_boundary(text, chars)
        while out and self.count(out) > tokens:
            out = head_at_boundary(text, len(out) - 1)
        return out

    def _tail_within(self, text: str, chars: int, tokens: int) -> str:
        out = tail_at_boundary(text, chars)
        while out and self.count(out) > tokens:
            out = tail_at_boundary(text, len(out) - 1)
        return out

    def count_structured(self, message: Message, fingerprint: str | None = None) -> int:
        """One message: role markers, every string field, name, tool_calls JSON, content parts.
        Cached by fingerprint (computed when not given: hashing is ~100x cheaper than
        tokenizing), so strategies that recount a history pay only for what changed."""
        if fingerprint is None:
            fingerprint = message_fingerprint(message)
        cached = self.cached(fingerprint)
        if cached is not None:
            return cached
        n = self.count_message(message)
        self._remember(fingerprint, n)
        return n

    def cached(self, fingerprint: str) -> int | None:
        """The count kept for a message's fingerprint, if any."""
        with self._lock:
            cached = self._cache.get(fingerprint)
            if cached is not None:
                self._cache.move_to_end(fingerprint)
                self.hits += 1
            return cached

    def keep(self, fingerprint: str, n: int) -> None:
        """Keep a message's count made elsewhere (by another process, with this tokenizer)."""
        self._remember(fingerprint, n)

    def count_message(self, message: Message) -> int:
        """One message's count, as `count_structured` gives it, read and kept nowhere."""
        n = TOKENS_PER_MESSAGE
        for key, value in message.items():
            if isinstance(value, str):
                n += self.count(value)
            elif key == "content" and isinstance(value, list):
                n += sum(self._count_part(part) for part in value)
            elif key == "tool_calls" and isinstance(value, list):
                n += sum(self._count_tool_call(call) for call in value)
            elif key == "function_call" and isinstance(value, dict):  # the legacy single call
                n += self._count_tool_call({"function": value})
            elif key == "items" and isinstance(value, list):
                n += sum(self._count_reasoning(item) for item in value)
        if "name" in message:
            n += TOKENS_PER_NAME
        return n

    def _count_part(self, part: Any) -> int:
        if isinstance(part, str):
            return self.count(part)
        if not isinstance(part, dict):
            return 0
        if isinstance(part.get("text"), str):
            return self.count(part["text"])
        kind = part.get("type")
        if kind in ("image_url", "input_image"):
            return IMAGE_TOKENS
        # Anthropic's tool blocks: what the model reads is the output, or the call's name and
        # input; their JSON (keys, ids, escaped quotes) would count a tool result ~17% high.
        if kind == "tool_result":
            inner = part.get("content")
            parts = inner if isinstance(inner, list) else [inner] if isinstance(inner, str) else []
            return TOKENS_PER_TOOL_CALL + sum(self._count_part(p) for p in parts)
        if kind == "tool_use":
            name = part.get("name")
            return (TOKENS_PER_TOOL_CALL + self.count(name if isinstance(name, str) else "")
                    + self.count(orjson.dumps(part.get("input")).decode()))
        return self.count(orjson.dumps(part).decode())

    def _count_reasoning(self, item: Any) -> int:
        """A Responses reasoning item an assistant turn carries (the wire items it came from,
        `items`): the provider reads its summary, an item of its own, framed as a message is;
        the turn's text and calls are counted from its content and tool_calls already."""
        if not isinstance(item, dict) or item.get("type") != "reasoning" or not isinstance(item.get("summary"), list):
            return 0
        texts = [s.get("text") for s in item["summary"] if isinstance(s, dict)]
        return TOKENS_PER_MESSAGE + TOKENS_PER_NAME + sum(self.count(t) for t in texts if isinstance(t, str))

    def _count_tool_call(self, call: Any) -> int:
        if not isinstance(call, dict):
            return 0
        fn = call.get("function") or {}
        n = TOKENS_PER_TOOL_CALL
        for key in ("name", "arguments"):
            value = fn.get(key)
            if isinstance(value, str):
                n += self.count(value)
        return n

    def count_messages(self, messages: list[Message], fingerprints: list[str] | None = None) -> int:
        if fingerprints is None:
            body = sum(self.count_structured(m) for m in messages)
        else:
            body = sum(self.count_structured(m, fp) for m, fp in zip(messages, fingerprints))
        return body + REPLY_PRIMING

    def count_tools(self, tools: list[dict[str, Any]] | None) -> int:
        """The `tools` schema: OpenAI does not publish its formula; this counts the JSON of
        each function plus a fixed overhead, which is slightly above what OpenAI bills."""
        if not tools:
            return 0
        # Agents resend the same schema every turn: cache it like a message.
        key = "tools:" + tools_fingerprint(tools)
        with self._lock:
            cached = self._cache.get(key)
        if cached is not None:
            return cached
        n = TOOLS_OVERHEAD
        for tool in tools:
            fn = tool.get("function", tool) if isinstance(tool, dict) else tool
            n += TOKENS_PER_TOOL + self.count(orjson.dumps(fn, option=orjson.OPT_SORT_KEYS).decode())
        with self._lock:
            self._cache[key] = n
        return n

    def count_request(self, messages: list[Message], tools: list[dict[str, Any]] | None = None,
                      fingerprints: list[str] | None = None) -> int:
        return self.count_messages(messages, fingerprints) + self.count_tools(tools)


def json_bound(body: bytes, parts: bool = True) -> int:
    """At least what a `byte_bounded` counter counts for every message and tool of a JSON
    request body, at the cost of a scan of its bytes. A string's JSON is at least its
    UTF-8 bytes, and the JSON around each message, part, call and tool (keys, quotes, braces)
    outweighs the fixed tokens counted for it; only an image, counted at a fixed cost larger
    than its JSON may be, is added per mention (of `image`: one scan, and any image part's
    type names it, `image_url` or `input_image`). `parts`: whether the messages may hold
    content parts (`holds_parts`); without any, there is no image, and no scan (0.26 ms of a
    new 107K conversation's 430 KB)."""
    images = body.count(b"image") if parts else 0
    return len(body) + IMAGE_TOKENS * images + REPLY_PRIMING + TOOLS_OVERHEAD


def holds_parts(messages: list[Message]) -> bool:
    """Whether any message's content is a list of parts (where an image can be)."""
    return any(type(m.get("content")) is list for m in messages)


@dataclass(frozen=True)
class TokenizerRule:
    pattern: str
    """A glob over the model name (`my-llama*`), matched against the alias and the upstream model."""
    tokenizer: str
    """`tiktoken:<encoding>`, `hf:<tokenizer.json | directory | cached repo id>`, or `estimate`."""


class TokenizerRegistry:
    """Chooses and caches one TokenCounter per tokenizer."""

    def __init__(self, rules: list[TokenizerRule] | None = None,
                 on_estimate: Callable[[str], None] | None = None) -> None:
        self.rules = list(rules or [])
        self._on_estimate = on_estimate
        self._counters: dict[str, TokenCounter] = {}
        self._resolved: dict[tuple[str, ...], TokenCounter] = {}
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    def validate(self) -> None:
        """Load every configured tokenizer now, so a bad rule fails at start, not mid-request."""
        for rule in self.rules:
            try:
                self.counter(rule.tokenizer)
            except Exception as e:
                raise ValueError(f"ctxgate.tokenizers: {rule.pattern!r} -> {rule.tokenizer!r}: {e}") from None

    def counter(self, spec: str) -> TokenCounter:
        with self._lock:
            found = self._counters.get(spec)
        if found is not None:
            return found
        kind, _, arg = spec.partition(":")
        if kind == "tiktoken":
            if arg not in _BUNDLED_ENCODINGS:
                raise ValueError(f"tiktoken encoding {arg!r} is not bundled offline"
                                 f" (have {', '.join(_BUNDLED_ENCODINGS)})")
            made = TokenCounter(spec, tiktoken_encoder(arg), byte_bounded=True)
        elif kind == "hf":
            made = TokenCounter(spec, HuggingFaceEncoder(arg))
        elif kind == "estimate":
            made = TokenCounter("estimate", EstimateEncoder(), exact=False, byte_bounded=True)
        else:
            raise ValueError("a tokenizer is tiktoken:<encoding>, hf:<path or repo id>, or estimate")
        with self._lock:
            return self._counters.setdefault(spec, made)

    def loaded(self) -> list[str]:
        """The tokenizers loaded so far, by spec."""
        with self._lock:
            return list(self._counters)

    def preload(self, *names: str) -> None:
        """Load the tokenizer a model counts with now: reading a BPE file takes a few hundred
        milliseconds and holds the GIL, which in a model's first request stalls every other one."""
        counter = self.counter(self._spec_for(tuple(n for n in names if n)))
        counter.count("ctxgate")
        counter.least(0)

    def for_model(self, *names: str, counting: bool = True) -> TokenCounter:
        """The counter for a model, given its alias and upstream names (first match wins).
        `counting`: a request will be counted with it (an estimate is noted, once per request)."""
        key = tuple(n for n in names if n)
        found = self._resolved.get(key)
        if found is None:
            found = self.counter(self._spec_for(key))
            self._resolved[key] = found
        if counting and not found.exact:
            self._note_estimate(key[0] if key else "?")
        return found

    def _spec_for(self, names: tuple[str, ...]) -> str:
        for rule in self.rules:
            if any(fnmatch.fnmatchcase(n, rule.pattern) for n in names):
                return rule.tokenizer
        for name in names:
            bare = name.rsplit("/", 1)[-1]
            encoding = _tiktoken_encoding(bare)
            if encoding is not None:
                return f"tiktoken:{encoding}"
            if "deepseek" in bare.lower() and DEEPSEEK_TOKENIZER is not None and DEEPSEEK_TOKENIZER.is_file():
                return f"hf:{DEEPSEEK_TOKENIZER}"
        return "estimate"

    def _note_estimate(self, model: str) -> None:
        if model not in self._warned:
            self._warned.add(model)
            log.warning("no tokenizer known for model %r: counting an estimate (UTF-8 bytes / 3); "
                        "add a ctxgate.tokenizers rule for exact counts", model)
        if self._on_estimate is not None:
            self._on_estimate(model)


def _tiktoken_encoding(model: str) -> str | None:
    encoding = MODEL_TO_ENCODING.get(model)
    if encoding is None:
        for prefix, enc in MODEL_PREFIX_TO_ENCODING.items():
            if model.startswith(prefix):
                encoding = enc
                break
    if encoding is None and model.startswith(("gpt-", "o1", "o3", "o4", "chatgpt-")):
        encoding = "o200k_base"  # a new OpenAI model tiktoken does not list yet
    if encoding is not None and encoding not in _BUNDLED_ENCODINGS:
        return None  # e.g. r50k models: not shipped offline, so estimate rather than download
    return encoding

