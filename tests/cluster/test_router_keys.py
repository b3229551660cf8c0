"""API keys only where they are checked (issue 24 item 4): the router holds keyed
digests, never a key; its key files are re-read while it serves, so a key is rotated or
revoked without a restart; a bad file at start stops it, a bad file later keeps the keys
it had."""

from __future__ import annotations

import asyncio
import logging
import pickle
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from cluster.config import load_config
from cluster.router_deployment import tenant_directory
from router.app import RouterSettings, build_app
from router.key_digests import KeyDigest, hash_keys
from router.key_files import KeyFileError, KeyFileWatcher
from router.tenants import TenantDirectory, TenantEntry

from .test_router_http import MODEL, FakeBackend

BODY = {"model": MODEL, "prompt": "x", "max_tokens": 2}


def client_for(tenants: TenantDirectory) -> TestClient:
    app = build_app(FakeBackend(), tenants=tenants, settings=RouterSettings(max_tokens_limit=8))
    return TestClient(app, raise_server_exceptions=False)


def status(client: TestClient, key: str) -> int:
    return client.post("/v1/completions", json=BODY,
                       headers={"authorization": f"Bearer {key}"}).status_code


def file_tenants(path: Path, *others: TenantEntry) -> TenantDirectory:
    return TenantDirectory([TenantEntry("ops", (), 1, False, key_file=str(path)), *others],
                           num_tiers=4)


def test_the_router_holds_digests_not_keys() -> None:
    cfg = load_config(overrides=["router.host=0.0.0.0",
                                 "tenants=[{name: a, api_keys: [sk-listed-1]}, "
                                 "{name: b, tier: 2, api_keys_env: B_KEYS}]"],
                      environ={"B_KEYS": "sk-env-2"})
    # What the router replica is given (and Serve's controller keeps): digests only.
    shipped = pickle.dumps(cfg.to_dict())
    directory = tenant_directory(cfg)
    at_rest = pickle.dumps(directory)  # everything the router keeps to check keys
    for key in ("sk-listed-1", "sk-env-2"):
        assert key.encode() not in shipped and key.encode() not in at_rest
    client = client_for(directory)
    assert status(client, "sk-listed-1") == 200 and status(client, "sk-env-2") == 200
    assert status(client, "sk-listed-") == 401 and status(client, "sk-env-2x") == 401


def test_digests_are_keyed_and_round_trip() -> None:
    (a,), (b,) = hash_keys(["k"]), hash_keys(["k"])
    assert a.salt != b.salt and a.digest != b.digest  # a fresh salt per hashing
    assert KeyDigest.parse(a.text()) == a and a.matches("k") and not a.matches("k ")
    for bad in ("sha256$00$00", "hmac-sha256$zz$00", "hmac-sha256$00$" + "00" * 31):
        with pytest.raises(ValueError, match="key digest"):
            KeyDigest.parse(bad)


def test_a_rotated_key_file_takes_effect_without_a_restart(tmp_path: Path) -> None:
    keys = tmp_path / "ops"
    keys.write_text("# ops team\nsk-old\n")
    directory = file_tenants(keys)
    watcher = KeyFileWatcher(directory)
    watcher.load()
    client = client_for(directory)  # one app, serving throughout
    assert status(client, "sk-old") == 200 and status(client, "sk-new") == 401
    assert asyncio.run(watcher.reload()) == []  # unchanged: nothing replaced
    # Rotation: the new key works and the old one is refused from the next request on.
    keys.write_text("sk-new\n")
    assert asyncio.run(watcher.reload()) == ["ops"]
    assert status(client, "sk-new") == 200 and status(client, "sk-old") == 401
    assert watcher.num_reloads == 1
    assert b"sk-new" not in pickle.dumps(directory)  # file keys are hashed at rest too


@pytest.mark.parametrize("damage", ["empty", "missing", "other_tenants_key", "not_utf8"])
def test_a_bad_key_file_keeps_the_keys_it_had(tmp_path: Path, damage: str,
                                              caplog: pytest.LogCaptureFixture) -> None:
    keys = tmp_path / "ops"
    keys.write_text("sk-ops\n")
    other = TenantEntry.with_keys("chat", ["sk-chat"], 0, False)
    directory = file_tenants(keys, other)
    watcher = KeyFileWatcher(directory)
    watcher.load()
    client = client_for(directory)
    writes: dict[str, Any] = {"empty": lambda: keys.write_text("# none yet\n"),
                              "missing": keys.unlink,
                              "other_tenants_key": lambda: keys.write_text("sk-chat\n"),
                              "not_utf8": lambda: keys.write_bytes(b"\xff\xfe\n")}
    writes[damage]()
    caplog.set_level(logging.INFO)
    assert asyncio.run(watcher.reload()) == []
    assert asyncio.run(watcher.reload()) == []
    assert status(client, "sk-ops") == 200
    # sk-chat stays chat's: a file cannot take another tenant's key.
    assert directory.authenticate("Bearer sk-chat").name == "chat"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "keeping its previous keys" in warnings[0].getMessage()
    assert "sk-" not in caplog.text  # the file is named, never a key
    # Fixed: the file's keys are taken again.
    keys.write_text("sk-ops-2\n")
    assert asyncio.run(watcher.reload()) == ["ops"]
    assert status(client, "sk-ops-2") == 200 and status(client, "sk-ops") == 401


def test_a_bad_key_file_at_start_stops_the_router(tmp_path: Path) -> None:
    missing = file_tenants(tmp_path / "absent")
    with pytest.raises(KeyFileError, match="absent: cannot read"):
        KeyFileWatcher(missing).load()
    empty = tmp_path / "empty"
    empty.write_text("\n# nothing\n")
    with pytest.raises(KeyFileError, match="holds no key"):
        KeyFileWatcher(file_tenants(empty)).load()
    # Until its file is read, a tenant with a key file refuses every caller.
    client = client_for(missing)
    assert status(client, "anything") == 401
    assert client.get("/health").status_code == 200
