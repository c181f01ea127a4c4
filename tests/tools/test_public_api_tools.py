"""The public surface of ``slotwise.tools``: ``__all__`` is what it offers, and its classes and
functions say ``slotwise.tools.X``."""

from __future__ import annotations

import inspect

import pytest

import slotwise.tools


def test_all_is_a_sorted_tuple_of_existing_public_names() -> None:
    names = slotwise.tools.__all__
    assert isinstance(names, tuple)
    assert list(names) == sorted(set(names))
    assert all(hasattr(slotwise.tools, name) and not name.startswith("_") for name in names)


def test_every_public_attribute_is_in_all() -> None:
    public = {name for name in vars(slotwise.tools) if not name.startswith("_")}
    assert public == set(slotwise.tools.__all__)


@pytest.mark.parametrize(
    "name",
    [
        name
        for name in slotwise.tools.__all__
        if inspect.isclass(getattr(slotwise.tools, name))
        or inspect.isfunction(getattr(slotwise.tools, name))
    ],
)
def test_public_names_say_slotwise_tools(name: str) -> None:
    assert getattr(slotwise.tools, name).__module__ == "slotwise.tools"
