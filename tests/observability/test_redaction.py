"""`redact` skips the pattern only for lines that cannot hold a secret."""

from __future__ import annotations

import pytest

from server.observability.redaction import _SECRETS, REDACTED, redact

SECRETS = [
    "GET /v1/models?api_key=sk-123&x=1",
    "GET /v1/models?API-KEY=sk-123",
    "GET /x;apikey=sk-123",
    "GET /x?access_token=abc",
    "token=abc",
    "authorization: Bearer sk-123",
    "Authorization: BASIC dXNlcjpwYXNz",
    "Ba\u017fic dXNlcjpwYXNz",  # a long s: the pattern's case-blind match takes it for s
    "bas\u0131c dXNlcjpwYXNz",  # a dotless i, likewise
    "ApI_KeY=sk-123",
    "sec-websocket-protocol: sluice.bearer.sk-123",
]


@pytest.mark.parametrize("line", SECRETS)
def test_every_secret_the_pattern_finds_is_redacted(line: str) -> None:
    assert _SECRETS.search(line) is not None
    clean = redact(line)
    assert REDACTED in clean
    assert "sk-123" not in clean and "dXNlcjpwYXNz" not in clean and "=abc" not in clean


def test_a_line_without_a_secret_is_handed_back_as_it_is() -> None:
    line = '{"request_id":"r1","tenant":"acme","model":"sluice-demo","status":200}'
    assert redact(line) is line
