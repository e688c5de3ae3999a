"""Every code block a reader of README.md or docs/ is told to run is run or parsed here.

```python blocks run whole, a page's blocks in order in one namespace (as a reader pastes them into
one session), on a small generated MNIST in a temporary folder. Each `towerlab ...` line of a
```bash block is parsed by towerlab's own argument parser, so an unknown flag fails. ```toml
blocks parse. Blocks that are not to be run (output samples, file layouts) are fenced ```text.
The results tables must equal what their records give (bench/tables.py).
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import numpy as np
import pytest

from towerlab.cli import build_parser
from towerlab.data.synthetic import make_synthetic
from towerlab.errors import UserError

from util import REPO

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LANGUAGES = {"bash", "python", "toml", "text"}
FENCE = re.compile(r"^```(\S*)\s*$")


def blocks(page: Path) -> list[tuple[str, str, int]]:
    """(language, code, line of the opening fence) of each fenced block of `page`."""
    found, open_at, language, lines = [], None, "", []
    for number, line in enumerate(page.read_text().splitlines(), 1):
        fence = FENCE.match(line)
        if open_at is None and fence:
            open_at, language, lines = number, fence[1], []
        elif open_at is not None and line.rstrip() == "```":
            found.append((language, "\n".join(lines) + "\n", open_at))
            open_at = None
        elif open_at is not None:
            lines.append(line)
    assert open_at is None, f"{page.name}:{open_at}: a code block is never closed"
    return found


def of_language(language: str) -> list[tuple[Path, str, int]]:
    return [(page, code, line) for page in PAGES for lang, code, line in blocks(page) if lang == language]


def towerlab_commands(code: str) -> list[list[str]]:
    """The arguments of each `towerlab ...` (or `python -m towerlab`, `torchrun ... -m towerlab`)
    command of a shell block: continuation lines joined, comments, pipes and redirections cut."""
    commands = []
    for line in code.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        tokens = list(lexer)
        start = 0
        for i, token in enumerate(tokens + [";"]):
            if i == len(tokens) or set(token) <= set("|&;<>()"):
                words = tokens[start:i]
                start = i + 1
                if words[:1] == ["towerlab"]:
                    commands.append(words[1:])
                elif "-m" in words and words[words.index("-m") + 1:words.index("-m") + 2] == ["towerlab"]:
                    commands.append(words[words.index("-m") + 2:])
    return commands


def test_every_block_says_what_it_is():
    unknown = [f"{page.name}:{line}: ```{lang}" for page in PAGES for lang, _, line in blocks(page)
               if lang not in LANGUAGES]
    assert not unknown, f"fence every block as one of {sorted(LANGUAGES)} (```text for output): {unknown}"


def test_the_pages_hold_blocks_of_each_kind():
    # The checks below would pass on pages whose blocks they no longer recognise: count what they see.
    assert len(of_language("python")) >= 3
    assert sum(len(towerlab_commands(code)) for _, code, _ in of_language("bash")) >= 40
    assert of_language("toml")


def test_the_command_parser_reads_a_shell_line():
    code = ("torchrun --nnodes 2 --rdzv-endpoint HOST:29500 \\\n    -m towerlab train --out runs/a  # comment\n"
            "towerlab search show runs/S --csv > evaluations.csv\npython bench/speed/run.py --suite cpu\n")
    assert towerlab_commands(code) == [["train", "--out", "runs/a"], ["search", "show", "runs/S", "--csv"]]


@pytest.mark.parametrize("page, code, line", of_language("bash"), ids=lambda v: v.name if isinstance(v, Path) else str(v))
def test_shell_blocks_parse(page, code, line):
    parser = build_parser()
    for argv in towerlab_commands(code):
        try:
            parser.parse_args(argv)
        except UserError as err:
            pytest.fail(f"{page.name}:{line}: towerlab {shlex.join(argv)}: {err}")


def test_an_unknown_flag_fails_the_shell_check():
    with pytest.raises(UserError, match="--epoch"):
        build_parser().parse_args(towerlab_commands("towerlab train --epoch 2\n")[0])


@pytest.mark.parametrize("page, code, line", of_language("toml"), ids=lambda v: v.name if isinstance(v, Path) else str(v))
def test_toml_blocks_parse(page, code, line):
    assert tomllib.loads(code), f"{page.name}:{line}: an empty TOML block"


def test_results_tables_equal_their_records():
    from bench import tables

    assert tables.differing() == [], "run python bench/tables.py"


@pytest.fixture
def small_mnist(tmp_path, monkeypatch):
    """A working folder whose data folder holds a learnable 8,000 + 1,000 image stand-in for MNIST (3,000 left to train on)."""
    data = tmp_path / "data"
    data.mkdir()
    arrays = make_synthetic((1, 28, 28), 8000, 1000)
    np.savez(data / "mnist.npz", **{k: v[:, 0] if k.startswith("x") else v for k, v in arrays.items()})
    monkeypatch.setenv("TOWERLAB_DATA", str(data))
    monkeypatch.chdir(tmp_path)
    return tmp_path


PYTHON_PAGES = sorted({page for page, _, _ in of_language("python")})


@pytest.mark.slow
@pytest.mark.parametrize("page", PYTHON_PAGES, ids=lambda p: p.name)
def test_python_blocks_run(page, small_mnist, monkeypatch):
    # As a reader's own session: a block that is a script of its own (docs/objectives.md's train.py) reads an
    # empty command line, not pytest's.
    monkeypatch.setattr(sys, "argv", [page.name])
    namespace = {"__name__": "__main__"}
    for lang, code, line in blocks(page):
        if lang == "python":
            exec(compile(code, f"{page.name}:{line}", "exec"), namespace)  # noqa: S102 - the page's own example
    assert list(small_mnist.glob("runs/*/summary.json")), f"{page.name}: its examples trained nothing"
