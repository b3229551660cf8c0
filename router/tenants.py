"""Who is calling and at which tier: API keys to tenants, tenants to tiers.

Data flow: the ``Authorization: Bearer <key>`` header -> :meth:`TenantDirectory.authenticate`
-> a :class:`TenantEntry` (before the body is read: ``router/access.py`` calls it for
every path but ``/health``), then the ``x-tierserve-tier`` header and the body's
``priority`` field -> :meth:`TenantDirectory.tier_for` -> the request's tier, or an
:class:`~router.protocol.ApiError` (401 bad key, 403 tier not allowed, 400 malformed
tier). Open access while no key is configured (the default, with the router bound to
127.0.0.1); keys are required once any exists.

Keys are kept only as SHA-256 digests and compared in constant time against every
digest (no early exit), so neither a key's bytes nor which tenant matched leak through
timing; no key ever appears in an error message or a log line.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from dataclasses import dataclass, field

from router.protocol import ApiError

TIER_HEADER = "x-tierserve-tier"
# The tier of anonymous callers while access is open (DESIGN §5: interactive).
OPEN_ACCESS_TIER = 1


@dataclass(frozen=True, slots=True)
class TenantEntry:
    name: str
    api_keys: tuple[str, ...] = field(repr=False)
    tier: int
    may_override_tier: bool
    # The most urgent tier the tenant may ask for (a smaller number is more urgent);
    # None: its own tier, so an override can only lower its priority.
    max_tier_override: int | None = None

    @property
    def ceiling(self) -> int:
        return self.tier if self.max_tier_override is None else self.max_tier_override


@dataclass(frozen=True, slots=True)
class Caller:
    tenant: str
    tier: int


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def _unauthorized(message: str) -> ApiError:
    return ApiError(401, message, type_="authentication_error", code="invalid_api_key",
                    headers={"www-authenticate": "Bearer"})


class TenantDirectory:
    def __init__(self, tenants: Sequence[TenantEntry], num_tiers: int) -> None:
        self._tenants = tuple(tenants)
        self._num_tiers = num_tiers
        self._digests = tuple((_digest(k), t) for t in self._tenants for k in t.api_keys)
        keyless = [t for t in self._tenants if not t.api_keys]
        # Open access is one trusted caller on loopback: it may pick any tier.
        self._anonymous = (
            keyless[0]
            if keyless
            else TenantEntry("anonymous", (), min(OPEN_ACCESS_TIER, num_tiers - 1), True, 0)
        )

    @property
    def requires_key(self) -> bool:
        return bool(self._digests)

    def authenticate(self, authorization: str | None) -> TenantEntry:
        """The caller's tenant from its ``Authorization`` header (401 when keys are
        required and it is missing, malformed or unknown)."""
        if not self.requires_key:
            return self._anonymous
        if not authorization:
            raise _unauthorized("missing API key: send 'Authorization: Bearer <key>'")
        scheme, _, key = authorization.partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise _unauthorized("malformed Authorization header: expected 'Bearer <key>'")
        digest = _digest(key)
        found: TenantEntry | None = None
        for known, tenant in self._digests:  # every digest, whatever matches
            if hmac.compare_digest(known, digest):
                found = tenant
        if found is None:
            raise _unauthorized("invalid API key")
        return found

    def tier_for(self, tenant: TenantEntry, tier_header: str | None,
                 priority: int | None) -> int:
        """The tier a request of ``tenant`` runs at: its own, or the one it asked for
        (header first, then ``priority``) where it may override, within its ceiling."""
        asked: int | None = priority
        if tier_header is not None:
            try:
                asked = int(tier_header.strip())
            except ValueError:
                raise ApiError(400, f"{TIER_HEADER}: not an integer: {tier_header[:32]!r}",
                               param=TIER_HEADER) from None
        if asked is None or asked == tenant.tier:
            return tenant.tier
        if not 0 <= asked < self._num_tiers:
            raise ApiError(400, f"tier {asked} does not exist (0..{self._num_tiers - 1})",
                           param="priority")
        if not tenant.may_override_tier:
            raise ApiError(403, f"tenant {tenant.name!r} may not choose tier {asked}",
                           type_="permission_error", param="priority", code="tier_not_allowed")
        if asked < tenant.ceiling:
            raise ApiError(403, f"tenant {tenant.name!r} may choose tiers {tenant.ceiling} to "
                           f"{self._num_tiers - 1}, not {asked}", type_="permission_error",
                           param="priority", code="tier_not_allowed")
        return asked

    def resolve(
        self, authorization: str | None, tier_header: str | None, priority: int | None
    ) -> Caller:
        tenant = self.authenticate(authorization)
        return Caller(tenant.name, self.tier_for(tenant, tier_header, priority))
