"""The pure core stays pure: no module of ``slotwise._core`` imports an async library, a
clock, I/O, logging or threads, nor the runtime and limiters built on it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import slotwise._core

CORE = Path(slotwise._core.__file__).parent
FORBIDDEN = (
    "anyio",
    "asyncio",
    "trio",
    "time",
    "psycopg",
    "psycopg_pool",
    "httpx",
    "httpx2",
    "opentelemetry",
    "logging",
    "sniffio",
    "threading",
    "slotwise._runtime",
    "slotwise.memory",
    "slotwise.postgres",
)
MODULES = sorted(CORE.rglob("*.py"))


def package_of(path: Path) -> str:
    """The dotted package that relative imports in ``path`` start from."""
    parts = path.relative_to(CORE.parent.parent).with_suffix("").parts
    return ".".join(parts[:-1])


def imported(source: str, package: str) -> set[str]:
    """Every module ``source`` imports, relative imports resolved against ``package``."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, module] if module else base)
            names.add(module)
            # `from slotwise import memory` imports a module as well.
            names.update(f"{module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            called = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
            if called in {"__import__", "import_module"}:
                names.add(str(node.args[0].value))
    return names


def forbidden(name: str) -> bool:
    return any(name == bad or name.startswith(f"{bad}.") for bad in FORBIDDEN)


def test_the_core_has_its_modules() -> None:
    assert {path.name for path in MODULES} >= {"__init__.py", "rules.py", "state.py"}


@pytest.mark.parametrize("path", MODULES, ids=lambda path: path.name)
def test_core_module_imports_nothing_impure(path: Path) -> None:
    names = imported(path.read_text(encoding="utf-8"), package_of(path))
    bad = sorted(name for name in names if forbidden(name))
    assert not bad, f"slotwise/_core/{path.name} imports {', '.join(bad)}"


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import time", True),
        ("import asyncio.events", True),
        ("from anyio import lowlevel", True),
        ("from logging import getLogger", True),
        ("from ..memory import MemoryLimiter", True),
        ("from .._runtime.lifecycle import slot", True),
        ("from .. import memory", True),
        ("from slotwise._runtime import keeper", True),
        ("importlib.import_module('trio')", True),
        ("__import__('threading')", True),
        ("from .rules import Rules", False),
        ("from .._errors import ConcurrencyQueueFullError", False),
        ("import heapq, itertools, secrets", False),
        ("import timeit", False),
    ],
)
def test_the_check_itself(source: str, expected: bool) -> None:
    names = imported(source, "slotwise._core")
    assert any(forbidden(name) for name in names) is expected
