"""Key rotation without a restart: the router re-reads its tenants' key files.

A tenant's ``api_keys_file`` is read by the router itself, never by the process that
loads the configuration, so its keys exist only where they are checked. On Kubernetes
it is a Secret mounted as files (the chart mounts it on the head pod only); the kubelet
swaps a changed Secret's files in atomically, so a read sees the old keys or the new
ones, never half a file.

Data flow::

    load() at router start ──read every file──▶ TenantDirectory.set_file_keys
        (a missing, unreadable or empty file: KeyFileError, the router does not start)
    run(interval_s) ──every interval: read the files off the event loop──▶ changed
        content? ──▶ set_file_keys: new keys accepted, removed keys refused from the
        next request on

A file that turns unreadable, empty or ambiguous (a key of another tenant) while the
router runs keeps the keys it last had, with a warning in the log: a half-finished
edit never locks every caller out. Revoke a key by writing the file without it.
Nothing here logs a key.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from pathlib import Path

from router.key_digests import parse_key_lines
from router.tenants import TenantDirectory

log = logging.getLogger(__name__)


class KeyFileError(ValueError):
    """A key file the router cannot use; the message names the file, never a key."""


def read_key_file(path: str) -> tuple[bytes, list[str]]:
    """(a fingerprint of the file's content, its keys); KeyFileError when unreadable or
    holding no key."""
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise KeyFileError(f"{path}: cannot read ({e.strerror})") from None
    try:
        keys = parse_key_lines(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise KeyFileError(f"{path}: not UTF-8 text") from None
    if not keys:
        raise KeyFileError(f"{path}: holds no key")
    return hashlib.sha256(raw).digest(), keys


class KeyFileWatcher:
    """Keeps a :class:`TenantDirectory`'s file keys equal to its key files' content."""

    def __init__(self, tenants: TenantDirectory) -> None:
        self.tenants = tenants
        self._fingerprints: dict[str, bytes] = {}  # tenant name -> content last applied
        self._failing: set[str] = set()  # warned about once, until the file is good again
        self.num_reloads = 0

    def load(self) -> None:
        """Read every key file (at router start): KeyFileError on the first bad one."""
        for name, path in self.tenants.key_files.items():
            fingerprint, keys = read_key_file(path)
            try:
                self.tenants.set_file_keys(name, keys)
            except ValueError as e:
                raise KeyFileError(str(e)) from None
            self._fingerprints[name] = fingerprint

    def _read_changed(self) -> dict[str, tuple[bytes, list[str]] | KeyFileError]:
        """The files whose content differs from what was applied (blocking reads)."""
        changed: dict[str, tuple[bytes, list[str]] | KeyFileError] = {}
        for name, path in self.tenants.key_files.items():
            try:
                found = read_key_file(path)
            except KeyFileError as e:
                changed[name] = e
                continue
            if found[0] != self._fingerprints.get(name):
                changed[name] = found
        return changed

    def _apply(self, changed: dict[str, tuple[bytes, list[str]] | KeyFileError]) -> list[str]:
        applied = []
        for name, found in changed.items():
            error: ValueError | None = found if isinstance(found, KeyFileError) else None
            if error is None:
                fingerprint, keys = found  # type: ignore[misc]
                try:
                    self.tenants.set_file_keys(name, keys)
                except ValueError as e:
                    error = e
            if error is not None:
                if name not in self._failing:
                    log.warning("tenant %s: %s; keeping its previous keys", name, error)
                self._failing.add(name)
                continue
            self._failing.discard(name)
            self._fingerprints[name] = fingerprint
            self.num_reloads += 1
            applied.append(name)
            log.info("tenant %s: key file changed, %d keys now", name, len(keys))
        return applied

    async def reload(self) -> list[str]:
        """Read the files off the event loop, apply what changed; the tenants whose keys
        were replaced."""
        changed = await asyncio.to_thread(self._read_changed)
        return self._apply(changed)

    async def run(self, interval_s: float) -> None:
        """Reload every ``interval_s`` until cancelled."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.reload()
            except Exception:  # a bug here must not end rotation for good
                log.exception("key file reload failed")
