"""What the wheel and the sdist carry, built by the project's own build backend.

hatchling's PEP 517 hooks run in a subprocess in the repository's root (they read the
project from the working directory), without build isolation: a build takes well under a
second.
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
PACKAGE = ROOT / "src" / "slotwise"


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    pytest.importorskip("hatchling", reason="hatchling is in the test extra")
    out = tmp_path_factory.mktemp("dist")
    script = (
        "import sys, hatchling.build as b; "
        "print(b.build_wheel(sys.argv[1])); print(b.build_sdist(sys.argv[1]))"
    )
    result = subprocess.run(
        [sys.executable, "-c", script, str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    wheel, sdist = result.stdout.split()
    return out / wheel, out / sdist


def test_the_license_is_mit() -> None:
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert text.startswith("MIT License\n")
    assert "The slotwise developers" in text


def test_the_wheel_carries_the_package_its_license_and_nothing_else(
    built: tuple[Path, Path],
) -> None:
    wheel, _ = built
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        license_text = archive.read(f"{info}/licenses/LICENSE").decode()
        metadata = archive.read(f"{info}/METADATA").decode()
    assert license_text == (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert "License-Expression: MIT" in metadata
    assert "License-File: LICENSE" in metadata
    assert "slotwise/py.typed" in names
    # Only the package and its metadata: no tests, docs, benchmarks or virtualenv.
    assert {n.split("/")[0] for n in names} == {"slotwise", info}
    modules = {f"slotwise/{p.relative_to(PACKAGE).as_posix()}" for p in PACKAGE.rglob("*.py")}
    assert modules <= set(names)


def test_the_sdist_carries_the_license_and_no_virtualenv(built: tuple[Path, Path]) -> None:
    _, sdist = built
    with tarfile.open(sdist) as archive:
        names = archive.getnames()
        top = names[0].split("/")[0]
        pkg_info = archive.extractfile(f"{top}/PKG-INFO")
        assert pkg_info is not None
        metadata = pkg_info.read().decode()
    files = {n.removeprefix(f"{top}/") for n in names}
    assert {"LICENSE", "pyproject.toml", "README.md", "src/slotwise/py.typed"} <= files
    assert "License-File: LICENSE" in metadata
    assert not [n for n in files if "venv" in n or n.endswith("pyvenv.cfg")]
    assert not [n for n in files if "__pycache__" in n or n.endswith(".pyc")]
