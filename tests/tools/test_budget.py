"""The result budget's arithmetic (pure): whole results under an equal share, the rest shared."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from slotwise.tools._budget import allowances, cut_note


@pytest.mark.parametrize(
    ("lengths", "budget", "kept"),
    [
        ([10, 20], 30, [10, 20]),  # everything fits: nothing is cut
        ([100, 250, 900, 2_000], 1_000, [100, 250, 325, 325]),
        ([10, 40, 200], 100, [10, 40, 50]),  # 40 is over 100/3 but under the share of 90/2
        ([500, 500], 101, [51, 50]),  # the leftover character goes to the first cut one
        ([5, 7], 0, [0, 0]),
        ([], 10, []),
    ],
)
def test_allowances(lengths: list[int], budget: int, kept: list[int]) -> None:
    assert allowances(lengths, budget) == kept


@given(st.lists(st.integers(0, 5_000), max_size=12), st.integers(0, 20_000))
def test_allowances_are_fair_and_fit(lengths: list[int], budget: int) -> None:
    kept = allowances(lengths, budget)
    assert len(kept) == len(lengths)
    assert all(0 <= k <= n for k, n in zip(kept, lengths, strict=True))
    if sum(lengths) <= budget:
        assert kept == lengths
        return
    assert sum(kept) == budget  # nothing of the budget is wasted
    cut = [i for i, (k, n) in enumerate(zip(kept, lengths, strict=True)) if k < n]
    for i in cut:  # no result keeps more than a cut one (but for a leftover character)
        assert all(k <= kept[i] + 1 for k in kept)
    share = budget // len(lengths)
    assert all(k == n for k, n in zip(kept, lengths, strict=True) if n <= share)


def test_the_note_says_how_much_was_cut_and_asks_for_less() -> None:
    assert cut_note(1_234, 5_000) == (
        "\n[1,234 of 5,000 characters cut to fit the tool output budget: "
        "ask for less, with a narrower query, to see more]"
    )
