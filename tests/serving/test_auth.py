"""Bearer tokens: parsing what the operator gives, and checking what a call carries."""

from __future__ import annotations

import pytest

from specdec.serving import errors
from specdec.serving.auth import parse_tokens

GOOD = "0123456789abcdef"


def test_tokens_from_the_variable_and_the_file_together(tmp_path):
    file = tmp_path / "tokens"
    file.write_text(f"# clients\nbob {GOOD}-bob   # the batch jobs\n\n")
    tokens = parse_tokens(f"alice:{GOOD}-alice", str(file))
    assert sorted(tokens.by_digest.values()) == ["alice", "bob"]
    assert tokens.client([("authorization", f"Bearer {GOOD}-bob")]) == "bob"
    assert tokens.client([("x", "y"), ("authorization", f"bearer  {GOOD}-alice")]) == "alice"
    assert parse_tokens("", "") is None  # authentication off


@pytest.mark.parametrize("metadata, message", [
    ([], "no credentials"),
    ([("authorization", GOOD + "-alice")], "must be 'Bearer <token>'"),
    ([("authorization", "Basic abc")], "must be 'Bearer <token>'"),
    ([("authorization", "Bearer " + GOOD + "-mallory")], "not one this coordinator accepts"),
])
def test_a_call_without_a_known_token_is_unauthenticated(metadata, message):
    tokens = parse_tokens(f"alice:{GOOD}-alice")
    with pytest.raises(errors.Unauthenticated, match=message):
        tokens.client(metadata)


@pytest.mark.parametrize("pairs, message", [
    ("alice:short", "shorter than 16 characters"),
    (f"bad name:{GOOD}", "expected NAME TOKEN"),
    (GOOD, "expected NAME TOKEN"),
    (f"a:{GOOD},b:{GOOD}", "entry 2: the same token as another entry"),
])
def test_bad_token_settings_fail_naming_the_entry_never_the_token(pairs, message):
    with pytest.raises(ValueError, match=message) as e:
        parse_tokens(pairs)
    assert GOOD not in str(e.value)


def test_a_missing_tokens_file_fails(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        parse_tokens("", str(tmp_path / "absent"))


def test_the_client_warns_before_sending_a_token_in_the_clear(caplog, monkeypatch):
    from specdec.serving.client import Client

    monkeypatch.delenv("SPECDEC_CLIENT_TLS_CA", raising=False)
    with caplog.at_level("WARNING", logger="specdec.client"):
        Client("127.0.0.1:1", token=GOOD).close()
        assert not caplog.records  # loopback: nothing crosses a network
        Client("10.0.0.7:50051", token=GOOD).close()
    assert "without TLS to 10.0.0.7:50051" in caplog.text and GOOD not in caplog.text
    with pytest.raises(ValueError, match="need tls_ca"):
        Client("10.0.0.7:50051", tls_cert="c.pem", tls_key="k.pem")
