"""API keys: format, hashing at rest, and what each role may do."""

import dataclasses

import pytest

from kuangchao.platform.security.apikeys import authenticate, key_id_of, new_key


def refused(key, stored) -> str:
    with pytest.raises(PermissionError) as info:
        authenticate(key, stored)
    return str(info.value).split(":")[0]


def test_a_key_is_shown_once_and_kept_only_as_a_hash():
    key, stored = new_key("alice", "team-a", "submitter")
    assert key.startswith("kc_") and key_id_of(key) == stored.principal.key_id
    assert key not in repr(stored) and len(stored.digest) == 64
    assert authenticate(key, stored).name == "alice"


def test_missing_malformed_tampered_unknown_expired_and_revoked_keys_are_refused():
    key, stored = new_key("alice", "team-a", "viewer")
    other, _ = new_key("bob", "team-b", "viewer")
    assert refused(None, stored) == "missing"
    assert refused("letmein", stored) == "malformed"
    # The right id with another secret: someone edited the key.
    tampered = key[:-4] + ("AAAA" if not key.endswith("AAAA") else "BBBB")
    assert refused(tampered, stored) == "tampered"
    assert refused(other, None) == "unknown"
    short, brief = new_key("carol", "team-a", "viewer", ttl_s=60)
    assert authenticate(short, brief, now=brief.principal.created_at + 59).name == "carol"
    with pytest.raises(PermissionError, match="^expired"):
        authenticate(short, brief, now=brief.principal.created_at + 60)
    with pytest.raises(ValueError, match="positive"):
        new_key("dave", "team-a", "viewer", ttl_s=0)
    revoked = dataclasses.replace(stored, principal=dataclasses.replace(stored.principal,
                                                                        revoked_at=1.0))
    assert refused(key, revoked) == "revoked"


def test_roles_and_tenants():
    _, viewer = new_key("v", "team-a", "viewer")
    _, operator = new_key("o", "ops", "operator")
    _, admin = new_key("a", "ops", "admin")
    v, o, a = viewer.principal, operator.principal, admin.principal
    assert v.can("job.read") and not v.can("job.submit") and not v.can("job.cancel")
    assert o.can("node.manage") and o.can("audit.read") and not o.can("key.manage")
    assert a.can("key.manage")
    assert v.sees("team-a") and not v.sees("team-b") and o.sees("team-b")
    with pytest.raises(ValueError, match="unknown"):
        new_key("x", "t", "root")
