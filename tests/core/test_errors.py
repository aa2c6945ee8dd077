"""The error taxonomy: each class says its own answer, and every table is derived from them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from server.core.errors import (
    ERRORS,
    OUTCOMES,
    REJECTION_CODES,
    GenerationFailed,
    InvalidRequest,
    RouteNotFound,
    SluiceError,
    restored,
)
from server.observability.metrics import Metrics

API_DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"


def every_class() -> list[type[SluiceError]]:
    """SluiceError and every subclass, found by walking the hierarchy (not the registry)."""
    found, todo = [], [SluiceError]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return found


def documented_error_rows() -> list[tuple[int, list[str], str, str, str]]:
    """(status, codes, retryable, capacity, when) for each row of the error table in docs/api.md."""
    text = API_DOC.read_text()
    section = text[text.index("## Errors") :]
    section = section[: section.index("\n## ", 1)]
    rows = []
    header_seen = False
    for line in section.splitlines():
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] == "Status":
            assert cells[1:4] == ["`code`", "Retryable", "Capacity"]
            header_seen = True
            continue
        if set(cells[0]) <= {"-", " "}:
            continue
        rows.append((int(cells[0]), re.findall(r"`([a-z_]+)`", cells[1]), *cells[2:5]))
    assert header_seen and rows
    return rows


def test_every_class_is_registered_once_per_answer() -> None:
    for cls in every_class():
        registered = ERRORS[(cls.status, cls.code)]
        # A class that shares its answer with another is a subclass that changed nothing of it.
        assert cls is registered or issubclass(cls, registered), cls
    assert ERRORS[(404, "not_found")] is RouteNotFound
    assert set(ERRORS.values()) <= set(every_class())


def test_each_class_declares_a_consistent_answer() -> None:
    for cls in every_class():
        assert cls.outcome in OUTCOMES, cls
        if cls.capacity:  # the service's own refusal: "not now", with a time to come back
            assert cls.status in (429, 503) and cls.retryable and cls.outcome == "rejected"
        if cls.retryable:
            assert cls.status in (429, 503), cls
        if cls.outcome == "invalid":
            assert 400 <= cls.status < 500, cls
        if cls.outcome == "failed":
            assert cls.status >= 500, cls


def test_derived_tables_agree_with_the_classes() -> None:
    assert REJECTION_CODES == tuple(
        code for (_, code), cls in ERRORS.items() if cls.outcome == "rejected"
    )
    assert len(set(REJECTION_CODES)) == len(REJECTION_CODES)
    # The series dashboards read exist, at zero, for every outcome and rejection reason.
    metrics = Metrics()
    metrics.initialise("m")
    exposition = metrics.exposition().decode()
    for outcome in OUTCOMES:
        assert f'outcome="{outcome}"' in exposition
    for code in REJECTION_CODES:
        assert f'reason="{code}"' in exposition


def test_the_outcome_labels_dashboards_count_are_kept() -> None:
    outcome = {code: cls.outcome for (_, code), cls in ERRORS.items()}
    assert outcome["deadline_exceeded"] == "expired"
    assert outcome["cancelled"] == "cancelled"
    assert {c for c, o in outcome.items() if o == "rejected"} == {
        "invalid_api_key",
        "forbidden",
        "tenant_quota_exceeded",
        "too_many_failed_attempts",
        "overloaded",
        "deadline_unmeetable",
        "engine_unavailable",
        "shutting_down",
        "store_unavailable",
    }
    assert {c for c, o in outcome.items() if o == "failed"} == {
        "adapter_load_failed",
        "generation_failed",
        "internal_error",
    }


@pytest.mark.parametrize("cls", every_class(), ids=lambda cls: cls.__name__)
def test_restored_round_trips_every_class(cls: type[SluiceError]) -> None:
    error = cls("it went wrong", param="max_tokens", retry_after=2.5)
    back = restored(error.status, error.to_body(), error.retry_after)
    assert type(back) is ERRORS[(cls.status, cls.code)]
    assert (back.status, back.to_body(), back.headers()) == (
        error.status,
        error.to_body(),
        error.headers(),
    )
    assert (back.outcome, back.retryable, back.capacity) == (
        cls.outcome,
        cls.retryable,
        cls.capacity,
    )


def test_restored_falls_back_for_an_answer_it_does_not_know() -> None:
    body = {"error": {"message": "m", "code": "no_such_code"}}
    assert type(restored(502, body)) is GenerationFailed
    assert type(restored(418, body)) is InvalidRequest
    assert type(restored(400, {})) is InvalidRequest


def test_the_documented_error_table_matches_the_taxonomy() -> None:
    listed: set[tuple[int, str]] = set()
    for status, codes, retryable, capacity, when in documented_error_rows():
        assert retryable in ("yes", "no") and capacity in ("yes", "no")
        assert ("`Retry-After`" in when) == (retryable == "yes"), (status, codes)
        for code in codes:
            cls = ERRORS.get((status, code))
            assert cls is not None, f"docs/api.md lists {status} {code}: no such error"
            assert cls.retryable == (retryable == "yes"), code
            assert cls.capacity == (capacity == "yes"), code
            listed.add((status, code))
    assert listed == set(ERRORS), set(ERRORS) - listed
