"""A deployment's admin key, registered from its Secret (`kc control-plane
start`), on the real Redis: idempotent, rotation revokes the old key, and a
revoked or clashing key is refused with the reason."""

from __future__ import annotations

import pytest

from kuangchao.platform.errors import ClusterError
from kuangchao.platform.runtime.bootstrap import BootstrapOptions, prepare, read_admin_key
from kuangchao.platform.security.apikeys import authenticate, new_key
from kuangchao.platform.security.keystore import KeyStore

pytestmark = pytest.mark.integration


def test_register_is_idempotent_and_rotation_revokes_the_old_key(store):
    keys = KeyStore(store)
    first, _ = new_key("x", "default", "admin")
    a = keys.register(first)
    assert keys.register(first) == a  # a restart of the sidecar changes nothing
    assert authenticate(first, keys.get(a.key_id)).role == "admin"
    second, _ = new_key("x", "default", "admin")
    b = keys.register(second)
    with pytest.raises(PermissionError, match="revoked"):
        authenticate(first, keys.get(a.key_id))
    assert authenticate(second, keys.get(b.key_id)).name == "deploy-admin"
    with pytest.raises(ValueError, match="was revoked"):
        keys.register(first)  # a rotated-out key never comes back
    clash = first[:20] + "y" * 43
    with pytest.raises(ValueError, match="taken"):
        keys.register(clash)
    other, _ = keys.create("alice", "t1", "submitter")
    keys.register(new_key("x", "default", "admin")[0])
    assert authenticate(other, keys.get(other.split("_")[1])).name == "alice"  # not a deploy key


def test_prepare_reports_a_bad_key_file_with_the_setting_to_fix(store, tmp_path):
    path = tmp_path / "admin-key"
    for text, needle in (("", "exactly one key"), ("kc_a kc_b", "exactly one key"),
                         ("kc_nothex_" + "x" * 43, "kc_<16 lowercase hex>")):
        path.write_text(text)
        with pytest.raises(ClusterError, match="admin key") as err:
            prepare(store, BootstrapOptions(admin_key_file=str(path)), print)
        assert needle in err.value.message
    with pytest.raises(ClusterError, match="KC_ADMIN_KEY_FILE"):
        read_admin_key(str(tmp_path / "missing"))
