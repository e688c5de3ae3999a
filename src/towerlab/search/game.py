"""The game every search plays (`Search.play`): its sampler proposes generations, `Rounds` serves each from
the store or has the `Trainer` train it (pruning as asked), the sampler is told the outcomes, and at the
end the top is crowned. A generation the store holds is read as it was recorded and never proposed again,
whoever proposed it: so a resumed search, a worker that takes over proposing and the job's record all
follow the one history the store holds, and pay for none of its proposals twice. A finished search is
only read. It is played one of two ways, as its sampler's shape says (`Shape.asynchronous`):

- in generations (`in_generations`: --population given, or a sampler that breeds generations, ga, or
  proposes everything at once, grid): each generation is proposed from the
  outcomes of those before it and, where the sampler overlaps, while the one before still trains (its
  genomes in flight). The history is the same however many workers train it, and resuming it proposes
  the same generations from the seed (the pinned histories, tests/test_search_pinned.py).
- asynchronously (`asynchronously`: the default of gp, tpe, random and auto): one candidate is proposed
  whenever the trainer can start one (`Pacing.pace`: a worker is idle, or a spare one should wait for
  the next worker to free up), from every outcome in hand, with every training still in flight told as
  running; the start-up design's random candidates go on the queue at once (`Sampler.startup`). A pruned
  one climbs its rungs as its results come in, each promotion decided against the trainings before it
  (`towerlab.search.rounds.Rounds.waiting`, `Rounds.peers`). A
  proposal for a worker that has nothing to take now, or will have nothing before the model's next one,
  where that would keep it waiting long (`Pace.quickly`), is made quickly (`Sampler.propose_quickly`: gp's
  is TPE's, a hundredth of its time), the others as the sampler makes them.
  So every worker trains whenever the search has budget left, however many join and whenever, and nobody
  waits for a proposal but the worker it is for, and not long. Which outcomes a proposal read depends on
  when they came in: the generation records it (`proposed`: the generations in flight then, whether it
  was made quickly, the workers busy and idle, the proposal's seconds), and a proposal is a function of
  those inputs and the seed alone (samplers carry no state from one proposal to the next), so the same
  inputs give the same candidate. Once the budget is spent, the workers that free up while the last
  trainings run re-measure the networks certain to be crowned, and then those likely to be
  (`Crowning.crown_ahead`), rather than wait for the end to start crowning.

No torch, no clock but the proposals' durations (recorded, never read back): the counts are defined in
`towerlab.search.history`, the budgets in `towerlab.search.samplers` and `towerlab.search.rounds`.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable, Optional

from towerlab.search.history import Generation, GenerationStats, Played
from towerlab.search.plan import generations_of, least
from towerlab.search.rounds import Rounds
from towerlab.search.samplers import InFlight, Sampler, budget_left
from towerlab.search.trainers import Pace, Pacing, Trainer

if TYPE_CHECKING:
    from towerlab.config import SearchConfig

# From this many members on, proposing and looking up a generation takes seconds to minutes:
# the search says what it is doing before it starts.
LARGE_GENERATION = 10_000
# A proposal that took this long is said while the next one is made (`Pacing.doing`): `search show`
# tells why a worker waits.
SLOW_PROPOSAL = 0.5


def in_generations(cfg: SearchConfig, sampler: Sampler, rounds: Rounds, replay: bool,
                   on_generation: Optional[Callable[[GenerationStats], None]] = None,
                   on_progress: Optional[Callable[[str], None]] = None) -> Played:
    """Play a search in generations (see the module's docstring); `replay`: it is finished, and read."""
    history: list[Generation] = []
    ahead: Optional[InFlight] = None  # the next generation, begun while the one before trained
    ended = "generations"
    while len(history) < generations_of(cfg):
        g = len(history)
        budget = budget_left(cfg, history)
        if budget == 0:
            ended = "max_evaluations"
            break
        if history and sampler.elite:
            history[-1] = rounds.crowning.crowned(history[-1], sampler.elite)
        queued = ahead is not None  # its first rung is on the queue already
        if ahead is not None:  # begun within the budgets as they stood then: it is played whole
            current, ahead = ahead, None
        else:
            budget = least(budget, rounds.epochs_left(g))  # the elite's re-measures are charged by now
            if budget == 0:
                ended = "budget_epochs"
                break
            genomes = rounds.recorded(g)
            if genomes is None and not replay:
                if on_progress is not None and sampler.population >= LARGE_GENERATION:
                    on_progress(f"Generation {g + 1}: proposing {sampler.population} candidates and looking "
                                "them up in the store ...")
                genomes = sampler.propose(history)
            if not genomes:
                ended = "sampler"
                break
            new = rounds.begin(g, genomes, budget, {"in_flight": []})
            current = InFlight(tuple(rounds.members(g)), new)
        overlap = sampler.overlaps and not sampler.elite and g + 1 < generations_of(cfg)
        # (the next generation's first rung is judged on those before this one: asked only where it overlaps)
        after = least(budget_left(cfg, history, current), rounds.epochs_left(g, current.new, True)) if overlap else 0
        if overlap and (after is None or after > 0):
            # The next generation is proposed now, with this one in flight, and its first rung goes on
            # the queue: a worker that finishes before this generation's last training takes it. This
            # one's first rung goes there first, so that no worker takes the next one's before it.
            if not queued:
                rounds.prefetch(g)
            following = rounds.recorded(g + 1)
            if following is None and not replay:
                following = sampler.propose(history, current)
            if following:
                new = rounds.begin(g + 1, following, after, {"in_flight": [g]})
                ahead = InFlight(tuple(rounds.members(g + 1)), new)
                rounds.prefetch(g + 1)
        generation = rounds.finish(g)
        sampler.tell(generation)
        history.append(generation)
        if on_generation is not None:
            on_generation(generation.stats)
    return Played(history, rounds.crowning.top(history, cfg.top), ended)


class _Flight:
    """An asynchronous search's generations begun and not yet told: each one's new trainings."""

    def __init__(self, rounds: Rounds) -> None:
        self.rounds, self.new = rounds, dict[int, int]()

    def in_flight(self) -> Optional[InFlight]:
        if not self.new:
            return None
        return InFlight(tuple(g for number in sorted(self.new) for g in self.rounds.members(number)),
                        sum(self.new.values()), len(self.new))


def asynchronously(cfg: SearchConfig, sampler: Sampler, rounds: Rounds, train: Trainer, replay: bool,
                   on_generation: Optional[Callable[[GenerationStats], None]] = None) -> Played:
    """Play a search asynchronously (see the module's docstring); `replay`: it is finished, and read."""
    pacing = train if isinstance(train, Pacing) else None
    told: list[Generation] = []  # in the order they were told
    flight = _Flight(rounds)
    number = 0  # the next generation's
    while (recorded := rounds.recorded(number)) is not None:
        flight.new[number] = rounds.begin(number, recorded)
        rounds.prefetch(number)  # a process stopped between recording it and queueing it left it off the queue
        number += 1
    exhausted = slow = False
    while True:
        ready, missing = rounds.waiting(sorted(flight.new)) if pacing else (set(flight.new), 0)
        for g in sorted(ready):
            generation = rounds.finish(g)  # (with no workers, trained here)
            if pacing is not None:  # how long a training takes, which a proposal's pace weighs
                pacing.trained([m.seconds for m in generation.members if m.ok and m.source == "evaluated"])
            sampler.tell(generation)
            told.append(generation)
            del flight.new[g]
            if on_generation is not None:
                on_generation(generation.stats)
        limit = _limit(cfg, rounds, told, flight, number, missing) or ("sampler" if exhausted or replay else None)
        if limit is not None and not flight.new:
            break
        proposed = 0
        if limit is None:
            pace = pacing.pace() if pacing else Pace(0 if flight.new else 1)
            # One at a time, the workers' pace looked at again before each (a worker that frees up meanwhile
            # gets a quick one), but the start-up's random candidates all at once.
            wanted = min(max(pace.wanted, sampler.startup - number), max(1, sampler.startup - number)) if pacing \
                else pace.wanted
            quickly = pace.quickly and number >= sampler.startup  # a worker would wait for the model's
            while proposed < wanted and not exhausted and _limit(cfg, rounds, told, flight, number, missing) is None:
                in_flight = flight.in_flight()
                budget = least(budget_left(cfg, told, in_flight), rounds.epochs_left(number, flying=missing))
                if pacing is not None and not quickly and slow:
                    pacing.doing(f"proposing generation {number + 1}")
                started = time.perf_counter()
                genomes = (sampler.propose_quickly if quickly else sampler.propose)(told, in_flight)
                seconds = time.perf_counter() - started
                if not genomes:
                    exhausted = True
                    break
                new = rounds.begin(number, genomes, budget, {
                    "in_flight": sorted(flight.new), "seconds": round(seconds, 4), "quickly": quickly, "by": pace.by,
                    "workers": {"busy": pace.busy, "idle": pace.idle}, "waiting": pace.waiting, "spare": pace.spare})
                flight.new[number] = new
                missing += new * rounds.sure(number)
                rounds.prefetch(number)
                number += 1
                proposed += 1
                if pacing is not None and not quickly and number > sampler.startup:  # the model's, not a draw
                    pacing.proposed(seconds)
                    slow = seconds >= SLOW_PROPOSAL
            if pacing is not None:
                pacing.doing("searching")
        elif pacing is not None:
            pacing.doing(f"ending: the budget is spent, {len(flight.new)} training(s) still running")
            if not replay and (in_flight := flight.in_flight()) is not None:
                # the workers that free up meanwhile re-measure the top that is certain already, and those
                # with nothing else to take the likely top (not under --budget-epochs, which counts every
                # re-measure: one of a network pushed out would pass it)
                idle = 0
                if cfg.budget_epochs is None:
                    pace = pacing.pace()
                    idle = max(0, pace.idle - pace.waiting)
                rounds.crowning.crown_ahead(told, cfg.top, len(in_flight.genomes), number - 1, idle)
        if pacing is not None and not ready and not proposed:
            pacing.wait()
    history = sorted(told, key=lambda g: g.generation)
    if pacing is not None and cfg.remeasure and not replay:
        pacing.doing("crowning: its top is re-measured")
    return Played(history, rounds.crowning.top(history, cfg.top), limit)


def _limit(cfg: SearchConfig, rounds: Rounds, told: list[Generation], flight: _Flight, number: int,
           missing: int) -> Optional[str]:
    """What ends an asynchronous search's proposals now, counting the trainings in flight (None: nothing):
    --max-evaluations, --budget-epochs, or its generations (which, not given, such a budget decides)."""
    if budget_left(cfg, told, flight.in_flight()) == 0:
        return "max_evaluations"
    if rounds.epochs_left(number, flying=missing) == 0:
        return "budget_epochs"
    if number >= generations_of(cfg):
        return "generations"
    return None
