"""Who is calling and at which tier: API keys to tenants, tenants to tiers.

Data flow: the ``Authorization: Bearer <key>`` header, the ``x-tierserve-tier`` header
and the body's ``priority`` field -> :meth:`TenantDirectory.resolve` -> a
:class:`Caller` (tenant name, tier) or an :class:`~router.protocol.ApiError` (401 bad
key, 403 tier not allowed, 400 malformed tier). Open access while no key is configured
(the default, with the router bound to 127.0.0.1); keys are required once any exists.
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence
from dataclasses import dataclass

from router.protocol import ApiError

TIER_HEADER = "x-tierserve-tier"
# The tier of anonymous callers while access is open (DESIGN §5: interactive).
OPEN_ACCESS_TIER = 1


@dataclass(frozen=True, slots=True)
class TenantEntry:
    name: str
    api_keys: tuple[str, ...]
    tier: int
    may_override_tier: bool


@dataclass(frozen=True, slots=True)
class Caller:
    tenant: str
    tier: int


class TenantDirectory:
    def __init__(self, tenants: Sequence[TenantEntry], num_tiers: int) -> None:
        self._tenants = tuple(tenants)
        self._num_tiers = num_tiers
        self._by_key = {k: t for t in self._tenants for k in t.api_keys}
        keyless = [t for t in self._tenants if not t.api_keys]
        self._anonymous = (
            keyless[0]
            if keyless
            else TenantEntry("anonymous", (), min(OPEN_ACCESS_TIER, num_tiers - 1), True)
        )

    @property
    def requires_key(self) -> bool:
        return bool(self._by_key)

    def _tenant_for(self, authorization: str | None) -> TenantEntry:
        if not self.requires_key:
            return self._anonymous
        if not authorization:
            raise ApiError(401, "missing API key: send 'Authorization: Bearer <key>'",
                           type_="authentication_error", code="invalid_api_key")
        scheme, _, key = authorization.partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise ApiError(401, "malformed Authorization header: expected 'Bearer <key>'",
                           type_="authentication_error", code="invalid_api_key")
        for known, tenant in self._by_key.items():
            if hmac.compare_digest(known.encode(), key.encode()):
                return tenant
        raise ApiError(401, "invalid API key", type_="authentication_error",
                       code="invalid_api_key")

    def resolve(
        self, authorization: str | None, tier_header: str | None, priority: int | None
    ) -> Caller:
        tenant = self._tenant_for(authorization)
        asked: int | None = priority
        if tier_header is not None:
            try:
                asked = int(tier_header.strip())
            except ValueError:
                raise ApiError(400, f"{TIER_HEADER}: not an integer: {tier_header!r}",
                               param=TIER_HEADER) from None
        if asked is None or asked == tenant.tier:
            return Caller(tenant.name, tenant.tier)
        if not 0 <= asked < self._num_tiers:
            raise ApiError(400, f"tier {asked} does not exist (0..{self._num_tiers - 1})",
                           param="priority")
        if not tenant.may_override_tier:
            raise ApiError(403, f"tenant {tenant.name!r} may not choose tier {asked}",
                           type_="permission_error", param="priority", code="tier_not_allowed")
        return Caller(tenant.name, asked)
