"""The public surface: ``slotwise.__all__`` is exactly what the package offers, and what it
offers says ``slotwise.X`` wherever it is defined."""

from __future__ import annotations

import importlib
import inspect
import sys
import types

import pytest

import slotwise

PUBLIC = sorted(slotwise.__all__)


def test_all_is_a_tuple_without_duplicates() -> None:
    assert isinstance(slotwise.__all__, tuple)
    assert len(set(slotwise.__all__)) == len(slotwise.__all__)


@pytest.mark.parametrize("name", PUBLIC)
def test_every_name_in_all_exists(name: str) -> None:
    assert hasattr(slotwise, name)


@pytest.mark.parametrize("name", PUBLIC)
def test_no_private_name_in_all(name: str) -> None:
    assert not name.startswith("_")


@pytest.mark.parametrize(
    "name",
    [
        name
        for name in PUBLIC
        if inspect.isclass(getattr(slotwise, name)) or inspect.isfunction(getattr(slotwise, name))
    ],
)
def test_public_classes_and_functions_say_slotwise(name: str) -> None:
    assert getattr(slotwise, name).__module__ == "slotwise"


def test_every_public_attribute_is_in_all() -> None:
    submodules = {
        name
        for name, value in vars(slotwise).items()
        if isinstance(value, types.ModuleType) and value.__name__ == f"slotwise.{name}"
    }
    public = {name for name in vars(slotwise) if not name.startswith("_")} - submodules
    missing = sorted(public - set(slotwise.__all__))
    assert not missing, f"public but not in __all__: {missing}"


def test_the_check_of_public_attributes_sees_the_submodules() -> None:
    # `slotwise.memory` is a public submodule: it is excluded from the check above by being a
    # module named slotwise.memory, not by being forgotten.
    assert isinstance(slotwise.memory, types.ModuleType)
    assert slotwise.memory.__name__ == "slotwise.memory"


@pytest.mark.parametrize("module", ["psycopg", "psycopg_pool"])
def test_slotwise_postgres_without_psycopg_names_the_extra(
    module: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    cached = [
        name
        for name in sys.modules
        if name == "slotwise.postgres" or name.startswith("slotwise.postgres.")
    ]
    for name in cached:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, module, None)
    try:
        with pytest.raises(ModuleNotFoundError) as raised:
            importlib.import_module("slotwise.postgres")
    finally:
        # What the failed import left behind goes; monkeypatch puts the cached modules back.
        for name in [n for n in sys.modules if n.startswith("slotwise.postgres")]:
            if name not in cached:
                del sys.modules[name]
    assert "pip install 'slotwise[postgres]'" in str(raised.value)
    assert raised.value.name == module
    assert isinstance(raised.value.__cause__, ModuleNotFoundError)
    assert raised.value.__cause__.name == module
