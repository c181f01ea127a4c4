"""The tutorial's programs pass ``mypy --strict``, run as written, and print what the page shows.

Each ``python title="stepN.py"`` block is a whole program, followed by a ``console`` block
with its output. Times and run ids differ from one run to the next: they are compared as
shapes (a number, an id).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

PAGE = Path(__file__).parent.parent / "docs" / "tutorial.md"
PROGRAM = re.compile(
    r'^```python title="(?P<name>step\d\.py)"\n(?P<body>.*?)^```\n.*?'
    r"^```console\n\$ python (?P=name)\n(?P<output>.*?)^```$",
    re.MULTILINE | re.DOTALL,
)
NUMBER = re.compile(r"\d+\.\d+")
RUN_ID = re.compile(r"\b[0-9a-f]{8}\b")


def programs() -> dict[str, tuple[str, str]]:
    """Each program's source and the output the page shows for it, by file name."""
    text = PAGE.read_text(encoding="utf-8")
    return {m["name"]: (m["body"], m["output"]) for m in PROGRAM.finditer(text)}


def shape(output: str) -> str:
    return RUN_ID.sub("<run id>", NUMBER.sub("<number>", output))


def test_the_page_has_four_programs_with_their_output() -> None:
    assert sorted(programs()) == ["step1.py", "step2.py", "step3.py", "step4.py"]


def test_the_programs_pass_mypy_strict(tmp_path: Path) -> None:
    files = []
    for name, (source, _) in programs().items():
        (tmp_path / name).write_text(source, encoding="utf-8")
        files.append(str(tmp_path / name))
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental", *files],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_programs_print_what_the_page_shows(tmp_path: Path) -> None:
    running = {}
    for name, (source, _) in programs().items():
        (tmp_path / name).write_text(source, encoding="utf-8")
        running[name] = subprocess.Popen(
            [sys.executable, name],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    outputs = {}
    for name, process in running.items():
        outputs[name], err = process.communicate(timeout=60)
        assert process.returncode == 0, f"{name}: {err}"
        assert shape(outputs[name]) == shape(programs()[name][1]), name
    # Step 3: the child run's slot names the root run as its parent.
    root, child, again = (RUN_ID.findall(line) for line in outputs["step3.py"].splitlines())
    assert child[1] == root[0] == again[0] != child[0]
