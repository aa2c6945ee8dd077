"""The bulk controller alone, on virtual time: a plant whose chats' gaps follow the scale (as
the step-time model maps a budget to sequences), and chats that end with their figures."""

from __future__ import annotations

import math

import pytest

from server.scheduler.attainment import MIN_GAPS, ChatMeter, Ended
from server.scheduler.controller import (
    AIM_BOUNDS,
    AIM_START,
    CEILING_MARGIN,
    CEILING_STEP,
    MIN_SPREAD,
    PACE_MIN,
    PACE_STEP,
    PERIOD_S,
    SCALE_BOUNDS,
    BulkController,
)
from server.scheduler.slo import SloTargets

TARGETS = SloTargets(ttft_s=0.1, itl_s=0.01)


def write_gaps(meter: ChatMeter, share: float, now: float, chunks: int = 2 * MIN_GAPS) -> None:
    for i in range(chunks):
        meter.gap(share, now - PERIOD_S * i / chunks)


def run_plant(
    controller: BulkController, meter: ChatMeter, model_error: float, periods: int
) -> list[float]:
    """Chats get `model_error` times the gap the model predicts for the budget the scale
    allows: a median gap share of `model_error x scale x aim at the start`."""
    scales = []
    now = 0.0
    for _ in range(periods):
        write_gaps(meter, model_error * controller.scale * AIM_START, now)
        controller.steer(now, meter, may_grow=True, may_shrink=True)
        scales.append(controller.scale)
        now += PERIOD_S
    return scales


# (the model's error, the periods within which the scale is most of the way to undoing it):
# chats getting twice the gaps predicted shrink bulk within about two seconds, half of them
# grow it within about four.
@pytest.mark.parametrize(("model_error", "periods"), [(2.0, 10), (0.5, 20)])
def test_the_scale_settles_where_chats_get_the_aim_without_overshoot(
    model_error: float, periods: int
) -> None:
    controller, meter = BulkController(0.97, enabled=True), ChatMeter()
    scales = run_plant(controller, meter, model_error, periods=150)
    assert scales[-1] == pytest.approx(1 / model_error, rel=0.02)
    # Monotone towards it: no move passes the point it settles at and comes back.
    settle = 1 / model_error
    assert all((s - settle) * (1 - settle) >= -1e-3 for s in scales)
    assert abs(math.log(scales[periods] * model_error)) < 0.3 * abs(math.log(model_error))


def test_gaps_over_the_aim_shrink_bulk_faster_than_gaps_as_far_under_it_grow_it() -> None:
    """On a host whose speed wanders, the window's median wanders about the aim: with growth
    the slower of the two, the loop does not let bulk start in every calm second."""
    moves = []
    for factor in (2.0, 0.5):
        controller, meter = BulkController(0.97, enabled=True), ChatMeter()
        write_gaps(meter, factor * controller.aim, 0.0)
        assert controller.steer(0.0, meter, may_grow=True, may_shrink=True)
        moves.append(abs(math.log(controller.scale)))
    shrink, grow = moves
    assert 0 < grow < shrink


def test_the_scale_grows_only_while_bulk_waits_at_its_cap_and_shrinks_only_above_its_floor() -> (
    None
):
    controller, meter = BulkController(0.97, enabled=True), ChatMeter()
    write_gaps(meter, 0.2, 0.0)  # much slack
    assert not controller.steer(0.0, meter, may_grow=False, may_shrink=True)
    assert controller.scale == 1.0
    meter = ChatMeter()
    write_gaps(meter, 3.0, 1.0)  # far over the target
    assert not controller.steer(1.0, meter, may_grow=True, may_shrink=False)
    assert controller.scale == 1.0
    assert controller.steer(1.2, meter, may_grow=True, may_shrink=True)
    assert controller.scale < 1.0


def test_the_scale_stays_within_its_bounds() -> None:
    controller, meter = BulkController(0.97, enabled=True), ChatMeter()
    now = 0.0
    for _ in range(500):
        write_gaps(meter, 50.0, now)
        controller.steer(now, meter, may_grow=True, may_shrink=True)
        now += PERIOD_S
    assert controller.scale == pytest.approx(SCALE_BOUNDS[0])


def test_too_few_gaps_move_nothing() -> None:
    controller, meter = BulkController(0.97, enabled=True), ChatMeter()
    write_gaps(meter, 5.0, 0.0, chunks=MIN_GAPS - 1)
    assert not controller.steer(0.0, meter, may_grow=True, may_shrink=True)
    assert controller.scale == 1.0


def test_gaps_older_than_the_window_are_forgotten() -> None:
    meter = ChatMeter(window_s=1.0)
    write_gaps(meter, 5.0, 0.0)
    assert meter.gap_median(0.0) == 5.0
    assert meter.gap_median(1.5) is None


def end_chats(meter: ChatMeter, shares: list[float | None]) -> None:
    for share in shares:
        meter.ended(
            Ended.of(TARGETS, median_gap_s=None if share is None else share * TARGETS.itl_s)
        )


def first_tokens(controller: BulkController, count: int, *, late: bool = False) -> None:
    for _ in range(count):
        controller.first_token(late=late)


def test_the_aim_is_one_over_the_goals_quantile_of_how_far_chats_stray() -> None:
    controller, meter = BulkController(0.95, enabled=True), ChatMeter()
    end_chats(meter, [AIM_START] * (MIN_SPREAD - 1))
    controller.steer(0.0, meter, may_grow=True, may_shrink=True)
    assert controller.aim == AIM_START  # too few chats yet
    # 100 chats: 94 at the aim they lived under, 6 at 1.25 times it. The 95% quantile is 1.25,
    # and a chat there is on its target when the aim is 1 / 1.25.
    end_chats(meter, [AIM_START] * 94 + [1.25 * AIM_START] * 6)
    controller.steer(0.2, meter, may_grow=True, may_shrink=True)
    assert controller.aim == pytest.approx(1 / 1.25)


def test_once_the_loop_holds_each_chat_over_its_target_lowers_a_ceiling_on_the_aim() -> None:
    """The quantile learns a spread at the bulk that ran; the bulk its aim then lets in may
    spread chats wider. Misses are counted at that bulk: once the inner loop has held its aim,
    each chat over its gap target lowers a ceiling on the aim, and chats within it raise it
    back, so that at most half the goal's misses are gaps (first tokens have the other half)."""
    controller, meter = BulkController(0.97, enabled=True), ChatMeter()
    # Before the loop first holds, misses are the model's first guess: the ceiling ignores them
    # (and so does the spread: its tail here is chats just on their target).
    end_chats(meter, [AIM_START] * 100 + [1.0] * 10 + [1.5] * 10)
    controller.steer(0.0, meter, may_grow=True, may_shrink=True)
    quantile = controller.aim
    assert quantile == pytest.approx(AIM_START / 1.0)  # the spread's tail
    # 250 calm chats, at 0.8 of that aim: the quantile says 1 / 0.8, the aim's bound holds it.
    # Chats' median gap share under the aim from the start is no hold yet: the loop has
    # corrected nothing, and a miss may still be its first guess.
    end_chats(meter, [0.8 * quantile] * 250)
    write_gaps(meter, 0.5 * AIM_BOUNDS[1], 0.2)
    controller.steer(0.2, meter, may_grow=True, may_shrink=True)
    assert controller.aim == AIM_BOUNDS[1] == controller.ceiling
    end_chats(meter, [1.1] * 2)  # (two: with the five below, too few to move the quantile)
    controller.steer(0.4, meter, may_grow=True, may_shrink=True)
    assert controller.aim == AIM_BOUNDS[1] == controller.ceiling
    # Over the aim, then back to it (a window apart): the loop has held.
    for now, share in ((2.0, 1.5 * AIM_BOUNDS[1]), (4.0, 0.5 * AIM_BOUNDS[1])):
        write_gaps(meter, share, now)
        controller.steer(now, meter, may_grow=True, may_shrink=True)
    # Five chats over their target: the ceiling falls by CEILING_STEP (about) each.
    end_chats(meter, [1.1] * 5)
    controller.steer(4.2, meter, may_grow=True, may_shrink=True)
    assert controller.aim == pytest.approx(AIM_BOUNDS[1] * math.exp(-5 * CEILING_STEP), rel=0.01)
    assert controller.spread_limit == AIM_BOUNDS[1]
    lowered = controller.aim
    # Chats within their target raise it back, 1.5% of a miss's fall each.
    end_chats(meter, [0.5] * 66)
    controller.steer(4.4, meter, may_grow=True, may_shrink=True)
    assert lowered < controller.aim == pytest.approx(lowered * math.exp(CEILING_STEP), rel=0.02)


def test_the_ceiling_does_not_wind_up_above_an_aim_it_does_not_set() -> None:
    """The ceiling starts at the hold just above the aim, and chats within their target raise
    it only while it is near the spread's limit: after a long calm run under an aim the spread
    set, a spread's limit that jumps moves the aim no further than the ceiling allows, and the
    ceiling then rises only as chats at each new aim keep their targets."""
    controller, meter = BulkController(0.97, enabled=True), ChatMeter()
    end_chats(meter, [AIM_START] * 100 + [0.9] * 10)
    controller.steer(0.0, meter, may_grow=True, may_shrink=True)
    assert controller.aim == pytest.approx(AIM_START / 0.9)  # the spread's tail
    for now, share in ((2.0, 1.5 * controller.aim), (4.0, 0.5 * controller.aim)):
        write_gaps(meter, share, now)
        controller.steer(now, meter, may_grow=True, may_shrink=True)
    assert controller.ceiling == pytest.approx(controller.aim * math.exp(CEILING_MARGIN))
    # A long calm run of chats just within their target, at the aim the spread sets.
    end_chats(meter, [0.99] * 2000)
    controller.steer(4.2, meter, may_grow=True, may_shrink=True)
    limit = controller.spread_limit
    assert limit == pytest.approx(AIM_START / 0.9 / 0.99)
    assert controller.aim == limit < controller.ceiling <= limit * math.exp(CEILING_MARGIN) * 1.001
    # The spread's limit jumps to the bound (chats at half their target): the aim stops at the
    # ceiling, and chats within their target raise it from there, 1.5% of a miss's fall each.
    end_chats(meter, [0.5 * limit] * 250)
    controller.steer(4.4, meter, may_grow=True, may_shrink=True)
    assert controller.spread_limit == AIM_BOUNDS[1]
    ceiling = controller.ceiling
    assert controller.aim == ceiling <= limit * math.exp(CEILING_MARGIN) * 1.001
    end_chats(meter, [0.5] * 66)
    controller.steer(4.6, meter, may_grow=True, may_shrink=True)
    assert controller.aim == pytest.approx(ceiling * math.exp(CEILING_STEP), rel=0.02)


def test_before_the_loop_holds_a_chat_over_its_target_is_no_part_of_the_spread() -> None:
    """A fresh server's first chats live under the model's first guess, before the loop has
    corrected it: those over their target measure that guess's error, not the spread the aim
    must leave room for. Kept, a handful of them would set the aim for the minute they stay
    among the last 250. Chats within their target are the spread's, before the hold and after,
    and so are misses once the loop holds."""
    controller, meter = BulkController(0.97, enabled=True), ChatMeter()
    end_chats(meter, [2 * AIM_START] * 10 + [0.6] * (MIN_SPREAD - 10))
    controller.steer(0.0, meter, may_grow=True, may_shrink=True)
    assert controller.aim == AIM_START  # the misses aside, too few chats yet
    end_chats(meter, [0.6] * 10)
    controller.steer(0.2, meter, may_grow=True, may_shrink=True)
    # Chats at 0.6 of their target under the start's aim: the bound holds the aim.
    assert controller.spread_limit == controller.aim == AIM_BOUNDS[1]
    for now, share in ((2.0, 1.5 * AIM_BOUNDS[1]), (4.0, 0.5 * AIM_BOUNDS[1])):
        write_gaps(meter, share, now)
        controller.steer(now, meter, may_grow=True, may_shrink=True)
    # Held: chats over their target are the spread's now (1.2 / 0.9: a limit of 0.75).
    end_chats(meter, [1.2] * 10)
    controller.steer(4.2, meter, may_grow=True, may_shrink=True)
    assert controller.spread_limit == pytest.approx(0.75)


def test_first_tokens_late_behind_bulk_slow_its_starts_and_come_back_as_others_keep_time() -> None:
    controller, meter = BulkController(0.97, enabled=True), ChatMeter()
    first_tokens(controller, 10)  # on time: the pace stays at the model's
    controller.steer(0.0, meter, may_grow=True, may_shrink=True)
    assert controller.pace == 1.0
    # Late behind bulk's prefills, three in one period: behind the same prefill, one slowing.
    first_tokens(controller, 3, late=True)
    controller.steer(0.2, meter, may_grow=True, may_shrink=True)
    assert controller.pace == pytest.approx(math.exp(-PACE_STEP), rel=0.02)
    assert controller.aim == AIM_START  # first tokens move the pace, not the aim
    first_tokens(controller, 2000)  # on time: the pace comes back, no further than 1
    controller.steer(0.4, meter, may_grow=True, may_shrink=True)
    assert controller.pace == 1.0
    # However many periods are late, bulk still starts, at PACE_MIN of the model's pace.
    for i in range(200):
        first_tokens(controller, 1, late=True)
        controller.steer(0.6 + i * PERIOD_S, meter, may_grow=True, may_shrink=True)
    assert controller.pace == pytest.approx(PACE_MIN)


def test_a_disabled_controller_is_never_due() -> None:
    assert not BulkController(0.97, enabled=False).due(0.0)
    assert BulkController(0.97, enabled=True).due(0.0)
