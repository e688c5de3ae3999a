"""What a command's trial runs, as its proof names it (`towerlab.objective.command`): the files its
arguments name once the genes are put in (each argument, and what follows an `=` in it: `train.py`,
`--config=cfg/a.json`), and the modules of yours that Python code among them imports, at its top or
inside a function (`towerlab.proof.imports`): each `.py` file they name (`python train.py`, `torchrun
train.py`, `accelerate launch train.py`), a script `python` runs whatever its name, and `python -m
MODULE`'s module; found as a fresh interpreter finds them: beside the script (for -m, in the current
folder), then on PYTHONPATH.

Parts are named so that none can take another's place: the command's text is THE_COMMAND (a name with a
space, which no module has), a file is its path as written, with `./` before a path that has no `/` (so a
file never has a module's name: `command` is `./command`), a module is its dotted name. A file inside a
trial's own folder is that trial's, never proven.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

from towerlab.proof import Finder, Proof, current_digest, file_digest, module_modules, script_modules

THE_COMMAND = "the command"
LISTED = 10_000  # the most words an argument with genes in it may be, each proven when a search starts
PYTHON_WORDS = 8  # the first arguments read for a Python program's options and its script (or -m module)
_PYTHON = re.compile(r"python(\d+(\.\d+)*)?")
_TAKES_VALUE = "WX"  # python's options whose value follows them (-W ignore, -X dev, or -Wignore)


def file_part(written: str) -> str:
    """A file's part name: its path as a command writes it, `./` before one without a `/`."""
    return written if "/" in written else f"./{written}"


def named_files(words: Sequence[str], own: Optional[Path] = None) -> dict[str, str]:
    """The files that `words` (a command's arguments, or the words one argument may be) name, by part name:
    each word, and what follows an `=` in it, that is a file now; not those inside `own` (a trial's folder)."""
    inside = None if own is None else os.path.join(os.path.realpath(own), "")
    found = {}
    for word in words:
        for written in {word, word.partition("=")[2]} - {""}:
            if os.path.isfile(written) and (inside is None or not os.path.realpath(written).startswith(inside)):
                found[file_part(written)] = written
    return found


def digests(files: Mapping[str, str], digest: Callable[[str], str]) -> dict[str, str]:
    """`digest` of each file of `files` (part name -> path) that can still be read."""
    found = {}
    for name, path in files.items():
        with contextlib.suppress(OSError):  # gone, or unreadable, since it was found: not named
            found[name] = digest(path)
    return found


@dataclass(frozen=True)
class PythonRun:
    """What `python [options] ...` runs: a `script` (a file) or a `module` (-m)."""

    script: Optional[str] = None
    module: Optional[str] = None


def python_run(argv: Sequence[str]) -> Optional[PythonRun]:
    """What `argv` runs where it is `python [options] FILE|-m MODULE ...` (python, python3, python3.12, by
    any path); None for any other program, `-c`, stdin, or what cannot be read as one of those."""
    if not argv or not _PYTHON.fullmatch(os.path.basename(argv[0])):
        return None
    at = 1
    while at < len(argv):
        word = argv[at]
        if word == "--" or not word.startswith("-") or word == "-":
            break
        if word.startswith("--"):
            if word == "--check-hash-based-pycs":
                at += 2
                continue
            return None  # --help, --version: nothing runs
        for i, letter in enumerate(word[1:], start=1):
            if letter == "c":
                return None  # the code is the command's text, proven as it is
            if letter == "m":
                name = word[i + 1:] or (argv[at + 1] if at + 1 < len(argv) else "")
                return PythonRun(module=name) if name else None
            if letter in _TAKES_VALUE:
                at += 0 if word[i + 1:] else 1
                break
        at += 1
    if at < len(argv) and argv[at] == "--":
        at += 1
    return None if at >= len(argv) or argv[at] == "-" else PythonRun(script=argv[at])


def code_modules(files: Sequence[str], runs: Sequence[PythonRun], digest: Callable[[str], str]) -> dict[str, str]:
    """The local modules, by name, each the `digest` of its file, that the Python code among `files` (those
    ending in .py) and `runs` imports (a script's own file is not one: the command names it)."""
    entries = os.environ.get("PYTHONPATH", "")
    python_path = [os.path.abspath(entry or ".") for entry in entries.split(os.pathsep)] if entries else []
    scripts = {path for path in files if path.endswith(".py")}
    scripts.update(run.script for run in runs if run.script is not None and os.path.isfile(run.script))
    found: dict[str, str] = {}
    for script in sorted(scripts):
        finder = Finder.fresh([os.path.dirname(os.path.abspath(script)), *python_path])
        found.update(script_modules(script, finder, digest))
    for module in sorted({run.module for run in runs if run.module is not None}):
        found.update(module_modules(module, Finder.fresh([os.getcwd(), *python_path]), digest))
    return found


def argument_words(pieces: Sequence[tuple[str, Optional[str]]], values: Mapping[str, Sequence[Any]],
                   text: Callable[[Any], str]) -> Optional[list[str]]:
    """Every word an argument (its `pieces`: text, or a placeholder's name) can be: its text, or each of the
    `values` of the genes in it, written by `text`; None where it holds what only a trial knows, a gene
    whose values are not listed, or would be more than LISTED words."""
    names = list(dict.fromkeys(name for _, name in pieces if name is not None))
    if any(name not in values for name in names) or math.prod(len(values[name]) for name in names) > LISTED:
        return None
    words = []
    for chosen in itertools.product(*(values[name] for name in names)):
        value = dict(zip(names, map(text, chosen)))
        words.append("".join(piece if name is None else value[name] for piece, name in pieces))
    return words


def python_runs(words: Sequence[Optional[Sequence[str]]]) -> set[PythonRun]:
    """What each Python program the arguments may be runs (`python_run`), from the words each of the first
    PYTHON_WORDS can be (`argument_words`), up to the first that cannot be listed (a script or module named
    past it is a trial's alone, checked when it runs)."""
    known: list[Sequence[str]] = []
    for possible in words[:PYTHON_WORDS]:
        if possible is None:
            break
        known.append(possible)
    runs = (python_run(argv) for argv in itertools.islice(itertools.product(*known), LISTED))
    return {run for run in runs if run is not None}


def trial_parts(argv: Sequence[str], own: Path, digest: Callable[[str], str]) -> Mapping[str, str]:
    """What a trial whose arguments are `argv` runs, by part name (the command's text aside): the files they
    name (outside the trial's folder `own`) and the modules of yours their Python code imports; each the
    `digest` of its file."""
    files = named_files(argv, own)
    run = python_run(argv)
    return {**digests(files, digest), **code_modules(list(files.values()), [run] if run else [], digest)}


def command_proof(text: str, arguments: Sequence[Sequence[tuple[str, Optional[str]]]],
                  values: Mapping[str, Sequence[Any]], written: Callable[[Any], str]) -> Proof:
    """The proof of a command (its `text`, its `arguments` as pieces) whose genes take `values` (written as a
    trial gets them by `written`), as this process's folder holds its files now: THE_COMMAND, every file an
    argument names with each value its genes can take (`argument_words`), and the modules of yours that its
    Python code imports (`code_modules`)."""
    parts = {THE_COMMAND: f"sha256:{hashlib.sha256(text.encode()).hexdigest()}"}
    words = [argument_words(pieces, values, written) for pieces in arguments]
    files = {name: path for possible in words for name, path in named_files(possible or ()).items()}
    parts.update(digests(files, file_digest))
    parts.update(code_modules(list(files.values()), sorted(python_runs(words), key=repr), file_digest))
    return Proof(parts)


def unproven(proved: Proof, argv: Sequence[str], own: Path) -> Optional[str]:
    """None where what a trial whose arguments are `argv` runs (`trial_parts`, its files as they are now) is
    what `proved` holds; else what differs, in words. A file it names that the proof lacks (not there when
    the proof was taken, or chosen by a value no list held: a float gene's, the seed's) is taken for one its
    program writes, as `towerlab.objective.yours.Yours.objective` takes it, and not compared; a module is always compared.
    A proven file that differs may be one the program writes: such a file belongs in the trial's folder."""
    parts = {name: digest for name, digest in trial_parts(argv, own, current_digest).items()
             if name in proved.parts or "/" not in name}
    problem = proved.covers(parts)
    if problem is not None and any("/" in name and proved.parts.get(name) != parts[name] for name in parts):
        problem += " (a file the program writes belongs in its trial's folder, {folder})"
    return problem
