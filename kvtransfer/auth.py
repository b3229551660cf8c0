"""Who may open a pair with a consumer: only a producer the cluster handed its ticket.

Each consumer draws a secret when it starts; its tickets carry it (they travel only on
the cluster's own control path: decode worker -> ``StartPrefill`` -> prefill worker). A
producer's ``Hello`` proves it holds the secret with an HMAC over the pair's name and its
own id; the consumer checks it in constant time and opens no process group, posts no
receive and reads no message for a pair that fails, or for a pair name it has seen before
(a replayed ``Hello``). The secret never goes into a log line, an error or a status.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets


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
