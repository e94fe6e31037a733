"""API keys: file and env parsing, Bearer checking, the bind-address default."""

from __future__ import annotations

from pathlib import Path

import pytest

from router.auth import (
    ALL_INTERFACES,
    ENV_VAR,
    LOOPBACK,
    RELOAD_S,
    ApiKeys,
    Entry,
    parse_key_file,
    read_keys,
)
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


def test_a_hash_inside_a_key_is_part_of_it_and_one_after_a_space_starts_a_comment() -> None:
    """`abc#def gamma` was read as key `abc` of tenant default (the rest a comment)."""
    assert parse_key_file("abc#def gamma\nsk-x # team-x\n#sk-y\n", "keys") == {
        "abc#def": Entry("gamma", "keys:1"),
        "sk-x": Entry("default", "keys:2"),
    }


def test_the_file_may_begin_with_a_byte_order_mark(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("sk-bom team\n", encoding="utf-8-sig")
    assert ApiKeys.load(path, env={}).authenticate("Bearer sk-bom") == "team"


def test_spaces_around_the_env_separators_are_not_part_of_key_or_tenant() -> None:
    keys = ApiKeys.load(None, env={ENV_VAR: " sk-a : team-a ,, sk-b ,"})
    assert keys.tenants == {"sk-a": "team-a", "sk-b": "default"}


@pytest.mark.parametrize(
    ("text", "env", "error"),
    [
        ("sk-dup alpha\nsk-ok\nsk-dup beta\n", "", r"keys:3: the key of .*keys:1 again"),
        ("sk-dup alpha\nsk-dup alpha\n", "", r"keys:2: the key of .*keys:1 again"),
        ("ключ-1 команда\n", "", r"keys:1: an API key is visible ASCII characters only"),
        ("sk-a unknown\n", "", r"keys:1: tenant 'unknown' is what calls with no key count as"),
        (
            "sk-b\nsk-a alpha\n",
            "sk-c,sk-a:beta",
            r"API_KEYS item 2 gives tenant 'beta' the key .*keys:2 gives tenant 'alpha'",
        ),
        ("", "sk-a:x,sk-a:y", r"item 2: the key of SLOS_SERVE_API_KEYS item 1 again"),
        ("", ":alpha", r"item 1: no key before the ':'"),
        ("", "sk-a:two words", r"item 1: tenant 'two words' holds a space"),
        ("", " , ,", r"SLOS_SERVE_API_KEYS is set but holds no key"),
    ],
)
def test_keys_that_conflict_or_no_client_could_send_stop_the_start(
    tmp_path: Path, text: str, env: str, error: str
) -> None:
    path = tmp_path / "keys"
    path.write_text(text)
    with pytest.raises(ValueError, match=error):
        ApiKeys.load(path if text else None, env={ENV_VAR: env})


def test_the_same_key_for_the_same_tenant_in_file_and_env_is_one_key(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("sk-a alpha\n")
    assert ApiKeys.load(path, env={ENV_VAR: "sk-a:alpha"}).tenants == {"sk-a": "alpha"}


def test_many_keys_each_find_their_tenant() -> None:
    keys = ApiKeys({f"sk-{i}": f"t{i % 7}" for i in range(10_000)})
    assert keys.authenticate("Bearer sk-9999") == "t3"
    with pytest.raises(Unauthorized):
        keys.authenticate("Bearer sk-10000")


def test_a_changed_keys_file_is_taken_within_the_reload_period(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A revoked key kept working until the door restarted (a Secret edited, a helm upgrade
    rendering the same RayService: nothing restarts). A file that does not parse keeps the
    keys in force."""
    now = [0.0]
    path = tmp_path / "keys"
    path.write_text("sk-old team\nsk-kept team\n")
    keys = ApiKeys(read_keys(path, {}), path, {}, clock=lambda: now[0])
    path.write_text("sk-kept team\nsk-new other-team\n")
    assert keys.authenticate("Bearer sk-old") == "team"  # not looked at again yet
    now[0] = RELOAD_S
    with pytest.raises(Unauthorized):
        keys.authenticate("Bearer sk-old")
    assert keys.authenticate("Bearer sk-new") == "other-team"
    path.write_text("# every key removed by mistake\n")
    now[0] = 2 * RELOAD_S
    assert keys.authenticate("Bearer sk-kept") == "team"
    assert "API keys not reloaded, those before stay in force" in caplog.text
    assert "holds no keys" in caplog.text


def test_a_keys_file_emptied_keeps_its_keys_beside_the_variables(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """With keys in SLOS_SERVE_API_KEYS too, a file emptied (truncated before it is written
    again) left only the variable's keys in force: every file key revoked at once. Started
    so, the file may be empty: the server is not open."""
    now = [0.0]
    path = tmp_path / "keys"
    path.write_text("sk-file team\n")
    env = {ENV_VAR: "sk-env:ops"}
    keys = ApiKeys(read_keys(path, env), path, env, clock=lambda: now[0])
    path.write_text("")
    now[0] = RELOAD_S
    assert keys.authenticate("Bearer sk-file") == "team"
    assert keys.authenticate("Bearer sk-env") == "ops"
    assert "holds no keys" in caplog.text
    path.write_text("sk-other team\n")
    now[0] = 2 * RELOAD_S
    with pytest.raises(Unauthorized):
        keys.authenticate("Bearer sk-file")
    assert ApiKeys.load(tmp_path / "keys", env).enabled
    path.write_text("# none yet\n")
    assert ApiKeys.load(path, env).tenants == {"sk-env": "ops"}


def test_an_error_about_the_variable_names_its_item_not_the_key() -> None:
    """The message goes to the log: it named the item whole, key included."""
    with pytest.raises(ValueError) as info:
        ApiKeys.load(None, env={ENV_VAR: "sk-secret-1:a, sk-secret-1:b"})
    assert "item 2" in str(info.value) and "sk-secret" not in str(info.value)
