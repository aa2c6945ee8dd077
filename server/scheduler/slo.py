"""A request's service-level objective: what it is promised (`SloTargets`), and whether, once
it ended, it met them (`slo_result`).

Interactive: completed, its first token within the TTFT target and the median gap of its
stream within the inter-token target. Bulk (no latency targets): completed. Refusals for
capacity, expiry and failure are misses; invalid input and a tenant's own refusals (key, class,
quota) do not count, nor does a client that left before any target was broken. The server
(`server/generations/timeline.py`) and the simulator judge every request with this one function.
A leaf: what measures chats against their targets (`attainment.py`) and what sets them
(`bulk_cap.py`, `targets.py`) import it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SloTargets:
    """What an interactive request is promised: seconds to its first token, and between
    tokens (the median gap of its stream)."""

    ttft_s: float
    itl_s: float


def slo_result(
    outcome: str,
    capacity_refusal: bool,
    waited_s: float,
    ttft_s: float | None,
    median_itl_s: float | None,
    targets: SloTargets | None,
) -> tuple[str, str] | None:
    """(result, reason) for sluice_slo_requests_total, or None when the request does not count.

    `outcome` is the request's (completed, rejected, expired, failed, cancelled, invalid),
    `capacity_refusal` whether it was refused for the service's capacity, not the tenant's own
    key or quota (its error class says which), `waited_s` its time from arrival to its end,
    and `targets` None for a class without latency targets.
    """
    if outcome == "completed":
        if targets is not None:
            if ttft_s is not None and ttft_s > targets.ttft_s:
                return ("missed", "ttft")
            if median_itl_s is not None and median_itl_s > targets.itl_s:
                return ("missed", "itl")
        return ("met", "none")
    if outcome in ("expired", "failed"):
        return ("missed", outcome)
    if outcome == "rejected" and capacity_refusal:
        return ("missed", "refused")
    if outcome == "cancelled" and targets is not None:
        first_token_s = waited_s if ttft_s is None else ttft_s
        if first_token_s > targets.ttft_s:  # it left after waiting longer than promised
            return ("missed", "ttft")
    return None
