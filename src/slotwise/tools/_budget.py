"""The result budget: how much of each result of a batch fits (pure: no I/O, no clock)."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ("allowances", "cut_note")


def allowances(lengths: Sequence[int], budget: int) -> list[int]:
    """How many characters of each result to keep so that all of them fit ``budget``.

    Results under an equal share of what is left stay whole; the rest share what remains
    equally (max-min fairness: no result is cut while a longer one keeps more). When
    everything fits, nothing is cut. The kept lengths add up to ``budget`` exactly when
    anything is cut.
    """
    if sum(lengths) <= budget:
        return list(lengths)
    kept = list(lengths)
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    remaining = budget
    for position, index in enumerate(order):
        left = len(order) - position
        share, extra = divmod(remaining, left)
        if lengths[index] <= share:
            remaining -= lengths[index]
            continue
        # This result and every longer one get the share; the characters the division
        # leaves over go to the first of them in the batch's order.
        for rank, cut in enumerate(sorted(order[position:])):
            kept[cut] = share + (rank < extra)
        break
    return kept


def cut_note(cut: int, length: int) -> str:
    """The note that ends a cut result (not counted against the budget)."""
    return (
        f"\n[{cut:,} of {length:,} characters cut to fit the tool output budget: "
        "ask for less, with a narrower query, to see more]"
    )
