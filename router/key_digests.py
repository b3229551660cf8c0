"""API keys at rest: keyed digests, never the keys themselves.

A key is kept as ``hmac-sha256$<salt hex>$<digest hex>``, the HMAC-SHA256 of the key's
UTF-8 bytes under a random 16-byte salt. The configuration tree hashes every listed key
when it is built (``cluster/config.py``), so the copy that ships to the router replica
(and that Ray Serve's controller stores to restart it) holds digests, not credentials:
a digest cannot be sent as a key, and guessing a key from it costs one HMAC per guess
per salt.

A caller's key is hashed once under each salt in use (one per configuration load, one
per router for its key files) and compared with every digest in constant time
(:func:`hmac.compare_digest`, no early exit), so neither the key's bytes nor which
tenant matched leak through timing. Key text in a file: one key per line, blank lines
and ``#`` comments skipped (:func:`parse_key_lines`).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Iterable
from dataclasses import dataclass, field

SCHEME = "hmac-sha256"
SALT_BYTES = 16
_DIGEST_BYTES = hashlib.sha256().digest_size


def new_salt() -> bytes:
    return secrets.token_bytes(SALT_BYTES)


def _hmac(salt: bytes, key: str) -> bytes:
    # surrogatepass: a header decoded as latin-1 never fails to encode
    return hmac.new(salt, key.encode("utf-8", "surrogatepass"), hashlib.sha256).digest()


@dataclass(frozen=True, slots=True)
class KeyDigest:
    salt: bytes
    digest: bytes = field(repr=False)

    @classmethod
    def of(cls, key: str, salt: bytes) -> KeyDigest:
        return cls(salt, _hmac(salt, key))

    def matches(self, key: str) -> bool:
        return hmac.compare_digest(self.digest, _hmac(self.salt, key))

    def text(self) -> str:
        return f"{SCHEME}${self.salt.hex()}${self.digest.hex()}"

    @classmethod
    def parse(cls, text: str) -> KeyDigest:
        """The digest written by :meth:`text`; ValueError saying what is wrong."""
        scheme, _, rest = text.partition("$")
        salt_hex, _, digest_hex = rest.partition("$")
        if scheme != SCHEME:
            raise ValueError(f"a key digest starts with '{SCHEME}$', not {scheme[:16]!r}")
        try:
            salt, digest = bytes.fromhex(salt_hex), bytes.fromhex(digest_hex)
        except ValueError:
            raise ValueError(f"a key digest is '{SCHEME}$<salt hex>$<digest hex>'") from None
        if not salt or len(digest) != _DIGEST_BYTES:
            raise ValueError(f"a key digest has a salt and a {_DIGEST_BYTES}-byte digest")
        return cls(salt, digest)


def hash_keys(keys: Iterable[str], salt: bytes | None = None) -> tuple[KeyDigest, ...]:
    """The digests of ``keys`` under one salt (a fresh one when None)."""
    salt = new_salt() if salt is None else salt
    return tuple(KeyDigest.of(k, salt) for k in keys)


def parse_key_lines(text: str) -> list[str]:
    """Keys in a key file: one a line; blank lines and ``#`` comments skipped."""
    return [ln.strip() for ln in text.splitlines()
            if ln.strip() and not ln.lstrip().startswith("#")]
