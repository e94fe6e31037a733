"""API keys: file and env parsing, Bearer checking, the bind-address default."""

from __future__ import annotations

from pathlib import Path

import pytest

from router.auth import ALL_INTERFACES, ENV_VAR, LOOPBACK, ApiKeys, parse_key_file
from router.errors import Unauthorized


def test_no_keys_accepts_everyone_and_binds_loopback() -> None:
    keys = ApiKeys.load(None, env={})
    assert not keys.enabled
    assert keys.authenticate(None) == "default"
    assert keys.bind_host(None, "test") == LOOPBACK
    assert keys.bind_host("0.0.0.0", "test") == "0.0.0.0"


def test_file_and_env_keys_map_to_tenants(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("# comment\nsk-a team-a\n\nsk-b   # no tenant\n")
    keys = ApiKeys.load(path, env={ENV_VAR: "sk-c:team-c, sk-d"})
    assert keys.authenticate("Bearer sk-a") == "team-a"
    assert keys.authenticate("bearer sk-b") == "default"
    assert keys.authenticate("Bearer sk-c") == "team-c"
    assert keys.authenticate("Bearer  sk-d ") == "default"
    assert keys.bind_host(None, "test") == ALL_INTERFACES


@pytest.mark.parametrize("header", [None, "", "sk-a", "Basic sk-a", "Bearer ", "Bearer sk-x"])
def test_bad_credentials_are_401(header: str | None) -> None:
    keys = ApiKeys({"sk-a": "t"})
    with pytest.raises(Unauthorized) as info:
        keys.authenticate(header)
    assert info.value.status == 401


def test_key_file_rejects_extra_words() -> None:
    with pytest.raises(ValueError, match="keys:2"):
        parse_key_file("ok tenant\nkey tenant extra\n", "keys")


def test_a_key_file_that_cannot_be_read_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^api_keys_file '.*none': No such file or directory$"):
        ApiKeys.load(tmp_path / "none", env={})


def test_a_key_file_with_no_keys_refuses_to_start_open(tmp_path: Path) -> None:
    """Every key revoked must not mean every caller let in; keys from the environment do."""
    path = tmp_path / "keys"
    path.write_text("# all keys revoked\n")
    with pytest.raises(ValueError, match=r"^api_keys_file '.*keys' holds no keys"):
        ApiKeys.load(path, env={})
    assert ApiKeys.load(path, env={ENV_VAR: "sk-e:team-e"}).authenticate("Bearer sk-e") == "team-e"
