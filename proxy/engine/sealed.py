"""Sealed references: the opaque `encrypted_content` of a compaction item ctxgate hands a
client (docs/native-context.md).

A reference names what a client-asked compaction kept (its session and the content-store
key) and when it stops being honoured. It is sealed with AES-256-GCM under the first of the
server's keys and opened with any of them, so keys rotate: add a new key first, keep the old
one until the references it sealed have expired. The tenant is the associated data: a
reference opens only for the tenant it was made for, and any changed byte fails the tag.
Every worker and replica reading the same keys opens what another sealed.
"""
from __future__ import annotations

import base64
import hashlib
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

import orjson
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

VERSION = b"\x01"
PREFIX = "ctxs1."
"""What every sealed reference starts with: a reader (and a log) tells them from OpenAI's."""
_KEY_ID_BYTES = 4
_NONCE_BYTES = 12
KEY_FILE = "sealing.key"
"""Where a gateway with no configured keys keeps the one it made (one process or one data dir only)."""


class SealError(Exception):
    """A reference that does not open: tampered, sealed for another tenant or under an unknown key, or expired."""


@dataclass(frozen=True)
class Reference:
    session_id: str
    ref: str
    """The content store's key of what the compaction kept."""
    expires_at: float


def _derived(secret: str) -> bytes:
    """A 256-bit key from a configured secret of any form (a passphrase or random bytes in base64)."""
    return hashlib.sha256(b"ctxgate-seal-v1\x00" + secret.encode()).digest()


def _key_id(key: bytes) -> bytes:
    return hashlib.sha256(b"id" + key).digest()[:_KEY_ID_BYTES]


class Sealer:
    def __init__(self, secrets_: list[str]) -> None:
        if not secrets_:
            raise ValueError("a sealer needs at least one key")
        self._keys = [_derived(s) for s in secrets_]
        self._by_id = {_key_id(k): AESGCM(k) for k in reversed(self._keys)}

    @classmethod
    def from_config(cls, keys: list[str], data_dir: Path) -> "Sealer":
        """The configured keys; without any, one made once and kept in the data directory
        (enough for one gateway; replicas must share configured keys)."""
        if keys:
            return cls(keys)
        path = data_dir / KEY_FILE
        if not path.exists():
            # Written whole under another name, then linked in place: workers starting together
            # all read the one key the first link made, never a half-written file.
            data_dir.mkdir(parents=True, exist_ok=True)
            draft = data_dir / f".{KEY_FILE}.{os.getpid()}.{secrets.token_hex(4)}"
            fd = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_urlsafe(32))
            try:
                os.link(draft, path)
            except FileExistsError:
                pass
            finally:
                draft.unlink()
        return cls([path.read_text().strip()])

    def seal(self, tenant: str, reference: Reference) -> str:
        key = self._keys[0]
        nonce = os.urandom(_NONCE_BYTES)
        plain = orjson.dumps({"s": reference.session_id, "r": reference.ref, "e": reference.expires_at})
        sealed = VERSION + _key_id(key) + nonce + AESGCM(key).encrypt(nonce, plain, tenant.encode())
        return PREFIX + base64.urlsafe_b64encode(sealed).decode().rstrip("=")

    def open(self, tenant: str, token: str) -> Reference:
        if not token.startswith(PREFIX):
            raise SealError("not a compaction item made by this gateway")
        body = token[len(PREFIX):]
        try:
            raw = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
        except ValueError:
            raise SealError("the compaction item is damaged") from None
        head = 1 + _KEY_ID_BYTES + _NONCE_BYTES
        if len(raw) <= head or raw[:1] != VERSION:
            raise SealError("the compaction item is damaged")
        aead = self._by_id.get(raw[1:1 + _KEY_ID_BYTES])
        if aead is None:
            raise SealError("the compaction item was sealed under a key this gateway no longer has")
        try:
            plain = aead.decrypt(raw[1 + _KEY_ID_BYTES:head], raw[head:], tenant.encode())
        except InvalidTag:
            raise SealError("the compaction item was altered, or belongs to another tenant") from None
        data = orjson.loads(plain)
        reference = Reference(str(data["s"]), str(data["r"]), float(data["e"]))
        if reference.expires_at < time.time():
            raise SealError("the compaction item has expired")
        return reference
