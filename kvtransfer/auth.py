"""Who may speak on a consumer's rendezvous: only a holder of the secret of its tickets.

Each consumer draws a secret when it starts; its tickets carry it (they travel only on
the cluster's own control path: decode worker -> ``StartPrefill`` -> prefill worker), so
the two ends of every pair hold it and nobody else does. The rendezvous store itself (a
TCPStore) has no authentication: anyone who reaches its port may read, write and pop any
key. So nothing read from it is trusted until this module has checked it:

* queue messages (the Hello, the rev stream, the store-carried fwd stream) are *sealed*:
  ``MAGIC | seq | HMAC(secret, key | seq | payload) | payload``. The key name is in the MAC
  (a message moved to another queue fails), and so is a sequence number that only grows on
  each stream (:class:`Opener` refuses one not past the last: a replay). A Hello has no
  stream of its own (many producers share the accept queue): its sequence is 0 and its
  replay is caught by its pair name, a fresh random one per pair, seen once.
* store values (the pair's process-group rendezvous, ``kvx/pg/{pair}/...``) are sealed
  with a random nonce, encrypted and MACed over the full key name
  (:func:`seal_value`, :func:`open_value`): an overwritten or swapped value is refused,
  and a reader of the store does not learn a gloo address to race the real peer to.

Every check is constant-time on the MAC, never raises anything but :class:`AuthError`
(bad bytes of any kind are a refusal, not a crash), and looks at the length first, so an
oversized value is refused before it is hashed. The secret never goes into a log line, an
error or a status. The producer's ``Hello`` also carries a proof over its pair and id
(:func:`pair_proof`), checked as before.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading

MAGIC = b"kvx1"
_SEQ_BYTES = 8
_MAC_BYTES = 32
_NONCE_BYTES = 16
SEAL_OVERHEAD = len(MAGIC) + _SEQ_BYTES + _MAC_BYTES
VALUE_OVERHEAD = len(MAGIC) + _NONCE_BYTES + _MAC_BYTES
MAX_VALUE_BYTES = 64 << 10  # a process group's rendezvous value (an address, an NCCL id)


class AuthError(ValueError):
    """A message or value that does not prove it came from a holder of the secret."""

    def __init__(self, message: str, *, kind: str) -> None:
        super().__init__(message)
        self.kind = kind  # "forged" | "replayed" | "oversize" (kvtransfer.guard.Refusal)


def new_secret() -> str:
    return secrets.token_hex(32)


def pair_proof(secret: str, pair: str, producer_id: str) -> str:
    msg = f"kvx-hello|{pair}|{producer_id}".encode()
    return hmac.new(secret.encode(), msg, hashlib.sha256).hexdigest()


def is_valid_proof(secret: str, pair: str, producer_id: str, proof: object) -> bool:
    """Whether ``proof`` (from a Hello: untrusted) proves the pair; never raises. Compared
    as bytes: ``compare_digest`` raises on a str with non-ASCII characters, and a raise here
    would end the consumer's accept loop (issue 24)."""
    if not isinstance(proof, str) or not isinstance(pair, str) or not isinstance(producer_id, str):
        return False
    want = pair_proof(secret, pair, producer_id).encode()
    return hmac.compare_digest(want, proof.encode("utf-8", "surrogatepass"))


def _subkey(secret: str, purpose: bytes) -> bytes:
    return hmac.new(secret.encode(), b"kvx-key|" + purpose, hashlib.sha256).digest()


def _mac(key: bytes, *parts: bytes) -> bytes:
    h = hmac.new(key, digestmod=hashlib.sha256)
    for part in parts:
        h.update(len(part).to_bytes(4, "big"))  # length-prefixed: no two splits collide
        h.update(part)
    return h.digest()


# -- queue messages ---------------------------------------------------------------------------


def seal(secret: str, key: str, seq: int, payload: bytes) -> bytes:
    """``payload`` for the queue ``key`` as message number ``seq`` of its stream."""
    head = MAGIC + seq.to_bytes(_SEQ_BYTES, "big")
    return head + _mac(_subkey(secret, b"msg"), key.encode(), head, payload) + payload


def unseal(secret: str, key: str, raw: object, *, max_bytes: int) -> tuple[int, bytes]:
    """``(seq, payload)`` of a sealed message read from ``key``; AuthError otherwise."""
    if not isinstance(raw, (bytes, bytearray)):
        raise AuthError("not bytes", kind="forged")
    if len(raw) > max_bytes + SEAL_OVERHEAD:
        raise AuthError(f"{len(raw)} bytes, more than {max_bytes}", kind="oversize")
    raw = bytes(raw)
    if len(raw) < SEAL_OVERHEAD or not raw.startswith(MAGIC):
        raise AuthError("not a sealed message", kind="forged")
    head, mac, payload = raw[:12], raw[12:SEAL_OVERHEAD], raw[SEAL_OVERHEAD:]
    if not hmac.compare_digest(mac, _mac(_subkey(secret, b"msg"), key.encode(), head, payload)):
        raise AuthError("its MAC does not verify", kind="forged")
    return int.from_bytes(head[len(MAGIC):], "big"), payload


class Sealer:
    """The writing end of one stream (one queue key): seals with a growing sequence."""

    def __init__(self, secret: str, key: str) -> None:
        self._secret, self.key = secret, key
        self._seq = 0
        self._lock = threading.Lock()

    def seal(self, payload: bytes) -> bytes:
        with self._lock:
            self._seq += 1
            seq = self._seq
        return seal(self._secret, self.key, seq, payload)


class Opener:
    """The reading end of one stream: refuses a forged message and a replayed one (a
    sequence not past the last accepted; a message popped by someone else leaves a gap,
    which is allowed: the store cannot stop a pop)."""

    def __init__(self, secret: str, key: str, max_bytes: int) -> None:
        self._secret, self.key, self._max = secret, key, max_bytes
        self._last = 0

    def open(self, raw: object) -> bytes:
        seq, payload = unseal(self._secret, self.key, raw, max_bytes=self._max)
        if seq <= self._last:
            raise AuthError(f"sequence {seq} replayed (last {self._last})", kind="replayed")
        self._last = seq
        return payload


# -- store values -----------------------------------------------------------------------------


def _keystream(key: bytes, nonce: bytes, n: int) -> bytes:
    """HMAC-SHA256 in counter mode (a PRF as a stream cipher): ``n`` bytes."""
    out = bytearray()
    counter = 0
    while len(out) < n:
        out += hmac.new(key, nonce + counter.to_bytes(8, "big"), hashlib.sha256).digest()
        counter += 1
    return bytes(out[:n])


def _xor(data: bytes, stream: bytes) -> bytes:
    return (int.from_bytes(data, "big") ^ int.from_bytes(stream, "big")).to_bytes(len(data), "big")


def seal_value(secret: str, key: str, value: bytes) -> bytes:
    """``value`` as stored under the full store key ``key``: encrypted, then MACed over the
    key, the nonce and the ciphertext (encrypt-then-MAC, separate subkeys)."""
    if len(value) > MAX_VALUE_BYTES:
        raise ValueError(f"a store value of {len(value)} bytes, more than {MAX_VALUE_BYTES}")
    nonce = secrets.token_bytes(_NONCE_BYTES)
    body = _xor(value, _keystream(_subkey(secret, b"enc"), nonce, len(value)))
    mac = _mac(_subkey(secret, b"val"), key.encode(), MAGIC + nonce, body)
    return MAGIC + nonce + mac + body


def open_value(secret: str, key: str, raw: object) -> bytes:
    """The value stored under ``key`` by a holder of the secret; AuthError otherwise."""
    if not isinstance(raw, (bytes, bytearray)):
        raise AuthError("not bytes", kind="forged")
    if len(raw) > MAX_VALUE_BYTES + VALUE_OVERHEAD:
        raise AuthError(f"a store value of {len(raw)} bytes", kind="oversize")
    raw = bytes(raw)
    if len(raw) < VALUE_OVERHEAD or not raw.startswith(MAGIC):
        raise AuthError("not a sealed value", kind="forged")
    nonce = raw[len(MAGIC):len(MAGIC) + _NONCE_BYTES]
    mac, body = raw[len(MAGIC) + _NONCE_BYTES:VALUE_OVERHEAD], raw[VALUE_OVERHEAD:]
    if not hmac.compare_digest(mac, _mac(_subkey(secret, b"val"), key.encode(), MAGIC + nonce,
                                         body)):
        raise AuthError("its MAC does not verify (overwritten or moved)", kind="forged")
    return _xor(body, _keystream(_subkey(secret, b"enc"), nonce, len(body)))
