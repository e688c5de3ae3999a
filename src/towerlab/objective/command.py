"""A command of yours as the objective (`--command 'python train.py --lr {lr} --epochs {epochs}'`): any
program, in any language, run once per trial.

The command is split into arguments first (shlex, as a POSIX shell splits words, quotes included) and
then each `{name}` inside an argument is replaced by the trial's value, so that a value is one
argument's text and never reaches a shell: there is none (`1; rm -rf x` is a string). A name is a gene
of the space, or what the search gives (`{seed}`, `{epochs}`, `{device}`, `{folder}`), or `{genes}`,
all the genes as one JSON object; `{{` and `}}` are braces. A string gene's value is its text, any
other value is written as JSON writes it (0.001, 1e-05, true). Checked before any trial runs, each a
UserError of one line: a name that is none of those, a gene that reaches the program neither by its
name nor through {genes}, a program that is not there, an argument that names a conditional gene and
anything else that is not its own (another gene, the program).

A conditional gene inactive in a trial is left out, as a script's option it does not get: the
argument that names it is dropped, and with it the flag just before it (an argument of its own that
starts with `-` and is not a number: `--rate-drop {rate_drop}` goes whole, as `--rate-drop={rate_drop}`
does), so that the program takes the option's default, as argparse gives one; {genes} leaves it out.
Passing a placeholder (an empty string, "None") instead would make each program parse a value that
means "absent", and an argparse `type=float` would fail on it.

The protocol: what the program prints on stdout, one line at a time: its last JSON object or bare number
is the result, the JSON objects before it with an "epoch" its learning curve, read within bounds
(`towerlab.objective.stdout`). stdout and stderr are kept in the trial's folder (stdout.txt, stderr.txt). A
non-zero exit, a signal, or no result fails the trial with the tail of stderr; so does a trial that runs past
the timeout (--trial-timeout). The program runs in a session of its own, and every process of it is
ended with it: on a timeout, on Ctrl-C (KeyboardInterrupt here) and on a worker's stop (`Trial.stop`),
with SIGTERM (SIGINT on a Ctrl-C), then SIGKILL after GRACE seconds; and whatever it leaves running once
it exits. A stop whose signal, sent to the worker's process group, killed the program's keeper as it was
being started (`KeeperLost`) stops the trial too, rather than fail it. Its device is given as programs
expect it: CUDA_VISIBLE_DEVICES is the one GPU of a cuda trial (an index into the worker's own
CUDA_VISIBLE_DEVICES where that is set), empty for any other; TOWERLAB_SEED, TOWERLAB_EPOCHS,
TOWERLAB_DEVICE, TOWERLAB_FOLDER and TOWERLAB_START say the rest (a command continues a lower rung's training
where it names `{start}`), and the environment is otherwise the worker's.

As a kind of objective (`Command`, "command", `towerlab.objective.yours.Yours`): a search's --command names it;
its proof lists the values of each gene that can be listed (`listed`), the files its arguments may name.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import string
import time
from pathlib import Path
from typing import Any, ClassVar, Mapping, Optional, Sequence

from towerlab.distributed.signals import Interrupted, signal_name
from towerlab.errors import UserError, did_you_mean
from towerlab.objective.result import Goal, Result, failed, read_result
from towerlab.objective.trial import EXTRAS, Trial
from towerlab.objective.yours import Yours
from towerlab.objective.files import command_proof, unproven
from towerlab.objective.deadline import check_timeout, timed_out
from towerlab.objective.process import ENDED, KeeperLost, start, stop_seen
from towerlab.objective.stdout import Unreadable, read_stdout
from towerlab.proof import Proof
from towerlab.search import Search
from towerlab.search.ranges import Range

GIVEN = (*EXTRAS, "genes")
LISTED = 10_000  # the most values of a range gene a command's proof lists (the files a gene may name)
TAIL_LINES = 5  # of stderr, in a failed trial's reason
TAIL_CHARS = 600

# An argument as pieces: literal text, or a placeholder's name.
Piece = tuple[str, Optional[str]]


def parse(command: str, genes: Sequence[str], conditional: Sequence[str] = ()) -> list[list[Piece]]:
    """The command's arguments, each as pieces (text, or a name to fill in); refuses what a trial could
    not run (see the module's docstring). `conditional`: the genes a trial may leave out."""
    clash = [gene for gene in genes if gene in GIVEN]
    if clash:
        raise UserError(f"--command: the space's gene {clash[0]!r} has the name of what the search gives every trial "
                        f"({', '.join(GIVEN)}): rename the gene")
    try:
        words = shlex.split(command)
    except ValueError as exc:
        raise UserError(f"--command {command!r}: {exc} (quote as a POSIX shell does)") from None
    if not words:
        raise UserError("--command: give the program to run and its arguments, e.g. "
                        "--command 'python train.py --lr {lr}'")
    arguments = []
    for word in words:
        try:
            fields = list(string.Formatter().parse(word))
        except ValueError as exc:
            raise UserError(f"--command: the argument {word!r}: {exc} (a brace of its own is written {{{{ or }}}})") \
                from None
        pieces: list[Piece] = []
        for text, name, spec, conversion in fields:
            if text:
                pieces.append((text, None))
            if name is None:
                continue
            if not name.isidentifier() or spec or conversion:
                raise UserError(f"--command: the argument {word!r} holds {{{name}{'!' + conversion if conversion else ''}"
                                f"{':' + spec if spec else ''}}}: a placeholder is a name alone, as {{lr}}")
            known = [*genes, *GIVEN]
            if name not in known:
                raise UserError(f"--command: {{{name}}} names neither a gene of the space ({', '.join(genes) or 'none'}) "
                                f"nor what the search gives ({', '.join(GIVEN)}){did_you_mean(name, known)}")
            pieces.append(("", name))
        arguments.append(pieces)
    named = {name for pieces in arguments for _, name in pieces}
    unused = [gene for gene in genes if gene not in named]
    if unused and "genes" not in named:
        raise UserError(f"--command: the gene {unused[0]!r} reaches the program nowhere: add {{{unused[0]}}} to the "
                        "command, or {genes} (every gene as one JSON object)")
    for at, (word, pieces) in enumerate(zip(words, arguments)):
        names = {name for _, name in pieces if name is not None}
        left_out = sorted(names & set(conditional))
        if left_out and (at == 0 or len(names) > 1):
            others = "the program" if at == 0 else ", ".join(f"{{{n}}}" for n in sorted(names - {left_out[0]}))
            raise UserError(f"--command: the argument {word!r} names the conditional gene {left_out[0]!r}, which a "
                            f"trial leaves out where it is inactive, and {others} with it: give "
                            f"{{{left_out[0]}}} an argument of its own")
    program = arguments[0]
    if all(name is None for _, name in program) and shutil.which(words[0]) is None:
        raise UserError(f"--command: no program {words[0]!r} here (not on PATH, or not executable)")
    return arguments


def _flag(pieces: list[Piece]) -> bool:
    """Whether an argument is an option's flag: literal text starting with `-`, not a number, not `-` or `--`."""
    if any(name is not None for _, name in pieces):
        return False
    word = "".join(text for text, _ in pieces)
    try:
        float(word)
    except ValueError:
        return word.startswith("-") and word not in ("-", "--")
    return False


def _text(value: Any) -> str:
    return value if isinstance(value, str) else str(value) if isinstance(value, Path) else json.dumps(value)


def _device_given(device: str) -> str:
    """The device as the program names it: "cuda" for a GPU (the one CUDA_VISIBLE_DEVICES leaves it), else as it is."""
    return "cuda" if device.partition(":")[0] == "cuda" else device


def _cuda_visible(device: str, ours: Optional[str]) -> str:
    """CUDA_VISIBLE_DEVICES for a trial on `device`: the GPU's index ("cuda" is the first), as the worker
    sees them (`ours`, its own CUDA_VISIBLE_DEVICES, where set: the trial's entry of it); empty where
    the device is not a GPU."""
    kind, _, index = device.partition(":")
    if kind != "cuda":
        return ""
    at = int(index or 0)
    visible = [entry.strip() for entry in (ours or "").split(",") if entry.strip()]
    return visible[at] if at < len(visible) else str(at)


class CommandObjective:
    """A command run per trial (see the module's docstring); `timeout`, in seconds, per trial (None: none);
    `values`, the values of each gene that they can be listed (a space's lists, its ranges of few values)."""

    kind = "command"

    def __init__(self, command: str, genes: Sequence[str], goal: Goal = Goal(), timeout: Optional[float] = None,
                 conditional: Sequence[str] = (), values: Optional[Mapping[str, Sequence[Any]]] = None):
        check_timeout(timeout)
        self.spec, self.goal, self.timeout = command, goal, timeout
        self.arguments = parse(command, list(genes), conditional)
        self.continues = "start" in {name for pieces in self.arguments for _, name in pieces}
        self.conditional = frozenset(conditional)
        self.values = dict(values or {})
        self._proved: Optional[Proof] = None

    def proof(self) -> Proof:
        """What its trials run (`towerlab.objective.files.command_proof`: its text, the files its arguments may
        name, the modules its Python code imports), taken once, when first asked (a worker joining a search)."""
        if self._proved is None:
            self._proved = command_proof(self.spec, self.arguments, self.values, _text)
        return self._proved

    def unproven(self, trial: Trial) -> Optional[str]:
        """None where what `trial` runs, as it is now, is what `proof()` holds; else what differs, in words."""
        return unproven(self.proof(), self.argv(trial), trial.folder)

    def argv(self, trial: Trial) -> list[str]:
        values = {**{name: _text(value) for name, value in trial.genes.items()},
                  **{name: _text(value) for name, value in trial.extras().items()},
                  "device": _device_given(trial.device),
                  "genes": json.dumps(dict(trial.genes), sort_keys=True)}
        return ["".join(text if name is None else values[name] for text, name in pieces)
                for pieces in self._given(trial.genes)]

    def _given(self, genes: Mapping[str, Any]) -> list[list[Piece]]:
        """The arguments a trial's program gets: those naming a conditional gene it leaves out dropped, each
        with the flag before it."""
        dropped = [any(name in self.conditional and name not in genes for _, name in pieces)
                   for pieces in self.arguments]
        for at in range(1, len(dropped)):
            if dropped[at] and _flag(self.arguments[at - 1]):
                dropped[at - 1] = True
        return [pieces for pieces, drop in zip(self.arguments, dropped) if not drop]

    def environment(self, trial: Trial) -> dict[str, str]:
        env = dict(os.environ)
        env.update(CUDA_VISIBLE_DEVICES=_cuda_visible(trial.device, os.environ.get("CUDA_VISIBLE_DEVICES")),
                   TOWERLAB_SEED=str(trial.seed), TOWERLAB_EPOCHS=str(trial.epochs),
                   TOWERLAB_DEVICE=_device_given(trial.device),
                   TOWERLAB_FOLDER=str(trial.folder), TOWERLAB_START=str(trial.start))
        return env

    def run(self, trial: Trial) -> Result:
        try:
            trial.folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            return failed(f"cannot make its folder {trial.folder}: {exc.strerror or exc}")
        out, err = trial.folder / "stdout.txt", trial.folder / "stderr.txt"
        argv = self.argv(trial)
        started = time.perf_counter()
        try:
            child = start(argv, self.environment(trial), out, err)
        except (OSError, ValueError) as exc:  # ValueError: a NUL in an argument (an edited genome)
            if isinstance(exc, KeeperLost) and (signum := stop_seen(trial.stop)):
                raise Interrupted(signum) from None  # the worker's stop: its trial is not over, it is put back
            return failed(f"cannot start {argv[0]!r}: {getattr(exc, 'strerror', None) or exc}",
                                    seconds=time.perf_counter() - started)
        ended = child.finish(self.timeout, trial.stop)
        seconds = time.perf_counter() - started
        if ended.timed_out:
            return failed(f"{timed_out(self.timeout or 0)}{_tail(err)}", seconds=seconds)
        if ended.signal:
            return failed(f"killed by {signal_name(ended.signal)}{_tail(err)}", seconds=seconds)
        if ended.status:
            return failed(f"exit status {ended.status}{_tail(err)}", seconds=seconds)
        try:
            returned, curve = read_stdout(out)
        except Unreadable as exc:
            return failed(str(exc), seconds=seconds)
        if returned is None:
            return failed("it printed no result (the last line of stdout that is a JSON object or a number)"
                                    f"{_tail(err)}", curve, seconds)
        return read_result(self.goal, returned, curve, seconds)


def _tail(path: Path) -> str:
    """`; stderr ends: ...` with the last TAIL_LINES lines of a file (at most TAIL_CHARS, control
    characters escaped), or nothing where it is empty."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 64 * 1024))
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    lines = [line.strip() for line in text.splitlines() if line.strip()][-TAIL_LINES:]
    said = " | ".join(lines)
    said = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in said)
    return f"; stderr ends: {'...' + said[-TAIL_CHARS:] if len(said) > TAIL_CHARS else said}" if said else ""


class Command(Yours):
    """A command of yours as a kind of objective (KINDS' "command"): `--command '...'`."""

    name: ClassVar[str] = "command"
    setting: ClassVar[Optional[str]] = "trial_command"
    flag: ClassVar[str] = "--command '...'"
    runs: ClassVar[str] = "a command"
    torch_here: ClassVar[bool] = False  # each trial is a process of its own

    @classmethod
    def runner(cls, search: Search, spec: str, function: object) -> CommandObjective:
        return CommandObjective(spec, list(search.space.genes), search.goal, timeout=search.cfg.trial_timeout,
                                conditional=list(search.space.when), values=listed(search))

    @classmethod
    def epochs_ignored(cls, runner: Any, how: str) -> Optional[str]:
        if "epochs" in {name for pieces in runner.arguments for _, name in pieces}:
            return None
        return (f"towerlab: warning: your command names no {{epochs}}, and {how}: unless the program reads "
                "$TOWERLAB_EPOCHS, each of its trials trains as long as any other")

    def _threads(self, threads: Optional[int]) -> Optional[int]:
        return None  # its program runs as it likes

    @property
    def lapses(self) -> Optional[float]:
        timeout = self.search.cfg.trial_timeout
        return None if timeout is None else timeout + ENDED


def listed(search: Search) -> dict[str, tuple]:
    """The values of each gene of `search`'s space that can be listed, as a trial gets them: a list's, an int
    range's of at most LISTED (a float's are not: each sampler computes its own)."""
    return {name: values if isinstance(values, tuple) else tuple(values.value_at(i) for i in range(int(values.count)))
            for name, values in search.space.genes.items()
            if not isinstance(values, Range) or (values.kind == "int" and values.count <= LISTED)}
