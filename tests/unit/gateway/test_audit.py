"""What the audit log keeps of a change: secrets are removed, whatever they are called or
wherever they sit."""

from __future__ import annotations

from gateway.audit import REDACTED, redact


def test_secret_fields_and_secret_shaped_text_are_redacted():
    key = "sk-strata-" + "a" * 43
    token = "sa-strata-" + "b" * 43
    change = {
        "name": "main",
        "secret": "anything",
        "Token": "anything",
        "nested": [{"cache_salt": "s"}, f"see {key} and {token}"],
        "policy": {"rpm": 10},
    }
    assert redact(change) == {
        "name": "main",
        "secret": REDACTED,
        "Token": REDACTED,
        "nested": [{"cache_salt": REDACTED}, f"see {REDACTED} and {REDACTED}"],
        "policy": {"rpm": 10},
    }
