"""Who is calling and at which tier: API keys to tenants, tenants to tiers.

Data flow: the ``Authorization: Bearer <key>`` header -> :meth:`TenantDirectory.authenticate`
-> a :class:`TenantEntry` (before the body is read: ``router/access.py`` calls it for
every path but ``/health``), then the ``x-tierserve-tier`` header and the body's
``priority`` field -> :meth:`TenantDirectory.tier_for` -> the request's tier, or an
:class:`~router.protocol.ApiError` (401 bad key, 403 tier not allowed, 400 malformed
tier). Open access while no key is configured (the default, with the router bound to
127.0.0.1); keys are required once any exists.

Keys are kept only as keyed digests (``router/key_digests.py``) and compared in constant
time against every digest, so neither a key's bytes nor which tenant matched leak
through timing; no key ever appears in an error message or a log line. A tenant's
``key_file`` keys are replaced while the router runs (:meth:`TenantDirectory.set_file_keys`,
called by ``router/key_files.py`` when the file changes): rotation without a restart.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from router.key_digests import KeyDigest, hash_keys, new_salt
from router.protocol import ApiError

TIER_HEADER = "x-tierserve-tier"
# The tier of anonymous callers while access is open (DESIGN §5: interactive).
OPEN_ACCESS_TIER = 1


@dataclass(frozen=True, slots=True)
class TenantEntry:
    name: str
    key_digests: tuple[KeyDigest, ...] = field(repr=False)
    tier: int
    may_override_tier: bool
    # The most urgent tier the tenant may ask for (a smaller number is more urgent);
    # None: its own tier, so an override can only lower its priority.
    max_tier_override: int | None = None
    # A file of more keys (a mounted Secret) that the router reads and re-reads when it
    # changes; a tenant with one requires a key even before the file is read.
    key_file: str | None = None

    @classmethod
    def with_keys(cls, name: str, keys: Iterable[str], tier: int, may_override_tier: bool,
                  max_tier_override: int | None = None) -> TenantEntry:
        """A tenant whose plain ``keys`` are hashed here and not kept."""
        return cls(name, hash_keys(keys), tier, may_override_tier, max_tier_override)

    @property
    def has_keys(self) -> bool:
        return bool(self.key_digests) or self.key_file is not None

    @property
    def ceiling(self) -> int:
        return self.tier if self.max_tier_override is None else self.max_tier_override


@dataclass(frozen=True, slots=True)
class Caller:
    tenant: str
    tier: int


def _unauthorized(message: str) -> ApiError:
    return ApiError(401, message, type_="authentication_error", code="invalid_api_key",
                    headers={"www-authenticate": "Bearer"})


class TenantDirectory:
    def __init__(self, tenants: Sequence[TenantEntry], num_tiers: int) -> None:
        self._tenants = tuple(tenants)
        self._num_tiers = num_tiers
        # Keys read from key files, hashed under this directory's own salt.
        self._file_salt = new_salt()
        self._file_digests: dict[str, tuple[KeyDigest, ...]] = {}
        self._table: tuple[tuple[bytes, tuple[tuple[KeyDigest, TenantEntry], ...]], ...] = ()
        self._rebuild()
        keyless = [t for t in self._tenants if not t.has_keys]
        # Open access is one trusted caller on loopback: it may pick any tier.
        self._anonymous = (
            keyless[0]
            if keyless
            else TenantEntry("anonymous", (), min(OPEN_ACCESS_TIER, num_tiers - 1), True, 0)
        )

    def _rebuild(self) -> None:
        """Group every digest by its salt, so a caller's key is hashed once per salt."""
        by_salt: dict[bytes, list[tuple[KeyDigest, TenantEntry]]] = {}
        for t in self._tenants:
            for d in (*t.key_digests, *self._file_digests.get(t.name, ())):
                by_salt.setdefault(d.salt, []).append((d, t))
        self._table = tuple((salt, tuple(entries)) for salt, entries in by_salt.items())

    @property
    def requires_key(self) -> bool:
        return any(t.has_keys for t in self._tenants)

    @property
    def key_files(self) -> dict[str, str]:
        """Tenant name -> the key file the router reads for it."""
        return {t.name: t.key_file for t in self._tenants if t.key_file is not None}

    def _match(self, key: str) -> TenantEntry | None:
        found: TenantEntry | None = None
        for salt, entries in self._table:
            digest = KeyDigest.of(key, salt).digest
            for known, tenant in entries:  # every digest, whatever matches
                if hmac.compare_digest(known.digest, digest):
                    found = tenant
        return found

    def set_file_keys(self, tenant_name: str, keys: Sequence[str]) -> None:
        """Replace the keys read from ``tenant_name``'s key file (its other keys stay).
        ValueError, naming no key, when there is none or one belongs to another tenant."""
        if tenant_name not in self.key_files:
            raise ValueError(f"tenant {tenant_name!r} has no key file")
        if not keys:
            raise ValueError(f"{self.key_files[tenant_name]}: holds no key")
        for key in keys:
            owner = self._match(key)
            if owner is not None and owner.name != tenant_name:
                raise ValueError(f"{self.key_files[tenant_name]}: a key already belongs to "
                                 f"tenant {owner.name!r}")
        self._file_digests[tenant_name] = hash_keys(keys, self._file_salt)
        self._rebuild()

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
        found = self._match(key)
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
