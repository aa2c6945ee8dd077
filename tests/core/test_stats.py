"""One percentile rule for the whole project: the nearest rank."""

from server.core.stats import nearest_rank, quantile


def test_the_nearest_rank_is_a_measured_value_with_q_of_the_values_at_or_below_it() -> None:
    values = [float(v) for v in range(1, 101)]  # 1 .. 100
    assert nearest_rank(values, 0.5) == 50.0
    assert nearest_rank(values, 0.99) == 99.0
    assert nearest_rank(values, 0.991) == 100.0
    assert nearest_rank(values, 1.0) == 100.0
    assert nearest_rank([7.0], 0.01) == 7.0


def test_quantile_sorts_and_says_none_for_no_values() -> None:
    assert quantile([3.0, 1.0, 2.0, 4.0], 0.5) == 2.0
    assert quantile(iter([5.0, 1.0]), 0.99) == 5.0
    assert quantile([], 0.5) is None
