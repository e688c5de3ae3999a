"""`--sampler gp`: Optuna's GPSampler, Bayesian optimisation with a Gaussian process: a model of
fitness fitted to every outcome so far, and each proposal the genome that maximises its expected
improvement (log EI; proposals asked while others train maximise the batch's, qLogEI, over those
others as trials still running, so that two workers are not sent the same way).

Each generation (`--population`: 1 by default, 2 in a pruned search, whose generation's members race
each other) is asked while the one before still trains, its genomes running trials of the model: so
two workers each train while the sampler proposes for the next, and the history is one whoever
trains. One a generation is asynchronous Bayesian optimisation on 2 workers: each proposal is made
with one training in flight, the fewest that keeps two workers busy (one with 2 a generation misses
2 or 3 outcomes; bench/lcbench.py measures the difference). The sampler is seeded from the search seed and each proposal is
made from the history alone (a study rebuilt from the members and the genomes in flight, asked by one
GPSampler kept from the first generation on), so replaying a stored search proposes the same
generations: a gp search resumes exactly, with the same Optuna and the same numerics. A float gene's
value is rounded to DIGITS significant digits: the model is told the value the candidate trained
with, and a replay whose floating point differs in its last bits (another machine's BLAS, greenlet
installed or not) still proposes the same genome (bench/lcbench_gp.py numerics measures it).

The model proposes once STARTUP trials (Optuna's default count) have been drawn at random: the
start-up design. Optuna's rule counts the trials complete when it is asked, and a generation is
asked while the one before trains, so GPSampler is told to start from STARTUP - population
complete ones: with its own rule, the generation in flight would be drawn at random again (12
random trials at 2 a generation, 11 at 1).

A listed gene is categorical, a range gene Optuna's int or float distribution, as for tpe. A
conditional gene is suggested only where it is active (towerlab.search.samplers.optuna_params), and
GPSampler models only the genes every complete trial holds: it draws a conditional one at random,
without a warning each trial (in a space without conditional genes it draws none so once the model
proposes). So auto hands a conditional space to TPE. A
failed candidate is told FAIL, one a pruned search stopped early PRUNED (the model reads only the
trainings that reached the last rung). Each proposal fits the model to every outcome again and
optimises its acquisition: on one core about 0.7 s a proposal at 100 outcomes, 1.9 s at 1,000 and
4.7 s at 2,000 (bench/lcbench_gp.py cpu), paid again by every worker's driver and by every replay
of the search on resume. A search that plans more than MOST_TRAININGS trainings is refused: auto
hands such searches to TPE after 250 outcomes.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Optional, Sequence

from towerlab.config import SamplerSettings, SearchConfig
from towerlab.errors import UserError
from towerlab.search.candidates import sampler_rng
from towerlab.search.history import Generation, Member
from towerlab.search.samplers import InFlight, Sampler, Shape, budget_left, random_genome
from towerlab.search.samplers.optuna_params import ask_genome, own_distributions
from towerlab.search.samplers.tpe import distribution, optuna_module
from towerlab.search.space import Range, Space, genome_hash

DIGITS = 8
STARTUP = 10
REPEATS, DRAWS = 3, 1000
MOST_TRAININGS = 2000


def optuna_for_gp() -> Any:
    """The optuna package, once it and what its GPSampler runs on are there (else a UserError saying
    how to install them)."""
    instead = " (or choose --sampler tpe, ga, random or grid)"
    optuna = optuna_module("the gp sampler (auto's choice for a space of numeric ranges alone)", instead)
    if int(optuna.__version__.split(".")[0]) < 5:
        raise UserError(f"the gp sampler needs Optuna 5.0 or later, whose Gaussian process proposes while others "
                        f"train (this is {optuna.__version__}): pip install -U 'towerlab[tpe]'{instead}")
    try:
        import scipy  # noqa: F401 - GPSampler optimises with SciPy's L-BFGS-B, which it imports when it first asks
    except ImportError:
        raise UserError(f"the gp sampler (auto's choice for a space of numeric ranges alone) needs SciPy: "
                        f"pip install 'towerlab[tpe]'{instead}") from None
    return optuna


class GPSampler(Sampler):
    default_population = 1
    default_generations = 20  # as many trainings as 10 of 2: the start-up's 10 and 10 of the model's
    # Asked with the generation before in flight: its genomes are running trials of the model.
    overlaps = True
    # From this many outcomes on, Optuna's TPE proposes (constant liar over the trials in flight)
    # instead of the Gaussian process (None: never): the auto sampler's, see towerlab.search.samplers.auto.
    tpe_after: Optional[int] = None

    @classmethod
    def shape(cls, cfg: SearchConfig, space: Space, settings: SamplerSettings) -> Shape:
        shape = super().shape(cfg, space, settings)
        if cfg.population is None and cfg.min_epochs is not None:  # a pruned generation's members race each other
            shape = dataclasses.replace(shape, population=2)
        optuna_for_gp()
        generations = cls.generations(cfg, space)
        planned = shape.population * generations
        planned = planned if cfg.max_evaluations is None else min(planned, cfg.max_evaluations)
        if cls.tpe_after is None and planned > MOST_TRAININGS:
            raise UserError(f"the gp sampler fits its Gaussian process to every outcome, whose cost grows with "
                            f"their number (4.7 s of CPU a proposal at 2,000): it takes at most {MOST_TRAININGS:,} "
                            f"trainings, and this search plans {planned:,} ({shape.population} x --generations "
                            f"{generations}, or --max-evaluations): give fewer, or choose --sampler auto, "
                            f"whose proposals are TPE's after 250 outcomes")
        return shape

    def __init__(self, cfg: SearchConfig, space: Space, rungs: int) -> None:
        super().__init__(cfg, space, rungs)
        optuna = self._optuna = optuna_for_gp()
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        with warnings.catch_warnings():  # GPSampler is "experimental" in some Optuna versions
            warnings.simplefilter("ignore")
            self._gp = optuna.samplers.GPSampler(seed=int(sampler_rng(cfg.seed, "gp").integers(2**32)),
                                                 n_startup_trials=max(1, STARTUP - self.population),
                                                 warn_independent_sampling=False)  # conditional genes: see below
        self._tpe: Any = None
        self._distributions = {name: distribution(optuna, values) for name, values in space.genes.items()}

    def propose(self, history: Sequence[Generation], in_flight: Optional[InFlight] = None) -> list[dict]:
        """`population` genomes the search has not proposed before, or fewer where --max-evaluations
        leaves fewer trainings, or none where the space holds no other."""
        optuna = self._optuna
        trials = [self._told(m) for generation in history for m in generation.members]
        study = optuna.create_study(direction="maximize", sampler=self._engine(trials))
        running = optuna.trial.TrialState.RUNNING
        trials += [optuna.trial.create_trial(params=g, distributions=own_distributions(self._distributions, g),
                                             state=running)
                   for g in (in_flight.genomes if in_flight else ())]
        study.add_trials(trials)
        budget = budget_left(self.cfg, history, in_flight)
        seen = self.proposed(history, in_flight)  # a set of its own: the proposals below are added to it
        genomes: list[dict] = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            while len(genomes) < (self.population if budget is None else min(self.population, budget)):
                genome = self._new(study, seen)
                if genome is None:
                    break
                genomes.append(genome)
                seen.add(genome_hash(genome))
        return genomes

    def _new(self, study: Any, seen: set[str]) -> Optional[dict]:
        """A genome not in `seen`: the model's, asked again while it repeats one (a repeat stays a
        running trial of the model, whose next proposal goes elsewhere), else, after REPEATS repeats,
        one drawn at random; None where DRAWS draws find none (the space is all but used up). A
        repeat would be served from the store and teach the model nothing: a search whose model
        had settled on one genome would go on proposing it, each generation training nothing."""
        for _ in range(REPEATS):
            _, asked = ask_genome(study, self.space, self._distributions)
            genome = {name: self._rounded(name, value) for name, value in asked.items()}
            if genome_hash(genome) not in seen:
                return genome
        rng = sampler_rng(self.cfg.seed, "gp", 2, len(seen))
        for _ in range(DRAWS):
            genome = random_genome(rng, self.space)
            if genome_hash(genome) not in seen:
                return genome
        return None

    def _engine(self, trials: list[Any]) -> Any:
        """What proposes from these trials: the Gaussian process, or past `tpe_after` outcomes TPE."""
        complete = self._optuna.trial.TrialState.COMPLETE
        if self.tpe_after is None or sum(t.state == complete for t in trials) < self.tpe_after:
            return self._gp
        if self._tpe is None:
            self._tpe = self._optuna.samplers.TPESampler(
                seed=int(sampler_rng(self.cfg.seed, "gp", 1).integers(2**32)), constant_liar=True)
        return self._tpe

    def _rounded(self, name: str, value: Any) -> Any:
        gene = self.space.genes[name]
        if isinstance(gene, Range) and gene.kind == "float" and gene.step is None:
            return gene.clip(float(f"{value:.{DIGITS}g}"))
        return value

    def _told(self, member: Member) -> Any:
        """The trial a member of the history is to the model."""
        states, create = self._optuna.trial.TrialState, self._optuna.trial.create_trial
        distributions = own_distributions(self._distributions, member.genome)
        if not member.ok:
            return create(params=member.genome, distributions=distributions, state=states.FAIL)
        if member.rung < self.rungs - 1:
            return create(params=member.genome, distributions=distributions, state=states.PRUNED,
                          intermediate_values={member.rung: member.score})
        return create(params=member.genome, distributions=distributions, value=member.score)
