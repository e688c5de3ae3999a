"""`--sampler gp`: Optuna's GPSampler, Bayesian optimisation with a Gaussian process: a model of
fitness fitted to every outcome so far, and each proposal the genome that maximises its expected
improvement (log EI; proposals asked while others train maximise the batch's, qLogEI, over those
others as trials still running, so that two workers are not sent the same way).

Without --population (the default, in a search that is not pruned) the search is asynchronous
Bayesian optimisation: one candidate is proposed whenever a worker needs one, with every training then
in flight a running trial of the model, so every worker trains while the model proposes, however many
there are. The first STARTUP proposals are drawn at random (the start-up design, on the queue at once:
they read no outcome); from then on the model proposes once it holds MIN_OUTCOMES outcomes (with 32
workers, the first few dozen proposals are made before that many have come back: random too). With
--population N (2 in a pruned search, whose generation's members race each other), each generation of
N is asked while the one before still trains, and GPSampler is told to start from STARTUP - N complete
trials (with its own rule, counting complete trials only, the generation in flight would be drawn at
random again): a history the same however many workers train it.

Each proposal is made from its inputs alone: a study rebuilt from the outcomes told (in generation
order) and the genomes in flight, asked by a GPSampler built for it, seeded from the search seed and
the generation's number. Nothing is carried from one proposal to the next (a GPSampler kept across
asks warm-starts each fit from the last one's kernel, so a difference in the last bits of one fit, two
CPU threads against one, changed every later proposal: a search replayed with 2 threads proposed
other members at its 85th generation than its workers, with 1, had). The search records each
proposal once, with its inputs, and never proposes a recorded one again. A float gene's value is
rounded to DIGITS significant digits: the model is told the value the candidate trained with.

A listed gene is categorical, a range gene Optuna's int or float distribution, as for tpe, but for an
int range of more than RELAXED values, which the Gaussian process takes as a float range and whose
proposals are rounded (`modelled`: Optuna searches an int gene's acquisition value by value, the bulk of
a proposal's time). A
conditional gene is suggested only where it is active (towerlab.search.samplers.optuna_params), and
GPSampler models only the genes every complete trial holds: alone, it would draw a conditional one at
random. So the Gaussian process is told every gene of every trial: where a genome lacks a gene (inactive
there), a stand-in drawn from the gene's distribution by a stream of the genome's own (`_filled`; the same
in every process). Scattered stand-ins tell the model that the gene does not matter where it is
inactive; one fixed stand-in left every other value of it unexplored there, and the model proposed that
branch again and again (its proposal of the inactive gene is not what it is then told). The quick
proposals (TPE) are told genomes as they are: TPE models a conditional gene from the trials that hold it.
auto runs gp on a conditional space that has a range in every trial (towerlab.search.samplers.auto:
measured on rbv2_xgboost). A
failed candidate is told FAIL. One a pruned search stopped early is told TPE as PRUNED, and the Gaussian
process (which reads complete trials alone) as complete at its score at the rung it reached: told nothing
of it, a model that had settled proposed beside it again and again, each proposal pruned in turn (an
asynchronous pruned search in one process, where nothing in flight steers it away). A shorter training
scores lower than the last rung would (a learning curve rises), so the score is a pessimistic one that
keeps the order its rung gave (the worst complete score instead would tell the model that the region of
the best networks, where most late proposals are pruned, is the worst). Each proposal fits the model to
every outcome again and optimises its acquisition: on one core about 0.1 to 0.4 s at 100 outcomes (more
with more trainings in flight), 1.9 s at 1,000 and 4.7 s at 2,000 (bench/quality/lcbench_gp.py cpu), paid
once per proposal, by the worker that proposes for the search. A search that plans more than
MOST_TRAININGS trainings is refused: auto hands such searches to TPE after 250 outcomes.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Mapping, Optional, Sequence

from towerlab.config import SamplerSettings, SearchConfig
from towerlab.errors import UserError
from towerlab.search.candidates import sampler_rng
from towerlab.search.history import Generation
from towerlab.search.samplers import InFlight, Sampler, Shape, budget_left, draw_gene, generation_number
from towerlab.search.samplers.tpe import as_it_is, asked_anew, distribution, optuna_module, prepared, study_of
from towerlab.search.space import Range, Space, genome_hash

DIGITS = 8
STARTUP = 10
MIN_OUTCOMES = 5  # an asynchronous search's model proposes once it holds this many outcomes (past its start-up)
RELAXED = 32  # an int range of more values is a float range to the Gaussian process (`modelled`)
MOST_TRAININGS = 2000


def optuna_for_gp() -> Any:
    """The optuna package, once it and what its GPSampler runs on are there (else a UserError saying
    how to install them)."""
    instead = " (or choose --sampler tpe, ga, random or grid)"
    optuna = optuna_module("the gp sampler (auto's choice where a numeric range is in every trial)", instead)
    if int(optuna.__version__.split(".")[0]) < 5:
        raise UserError(f"the gp sampler needs Optuna 5.0 or later, whose Gaussian process proposes while others "
                        f"train (this is {optuna.__version__}): pip install -U 'towerlab[tpe]'{instead}")
    try:
        import scipy  # noqa: F401 - GPSampler optimises with SciPy's L-BFGS-B, which it imports when it first asks
    except ImportError:
        raise UserError(f"the gp sampler (auto's choice where a numeric range is in every trial) needs SciPy: "
                        f"pip install 'towerlab[tpe]'{instead}") from None
    return optuna


class GPSampler(Sampler):
    default_population = 1
    default_generations = 20  # as many trainings as 10 of 2: the start-up's 10 and 10 of the model's
    # Asked with the generation before in flight: its genomes are running trials of the model.
    overlaps = True
    can_wait_less = True
    # From this many outcomes on, Optuna's TPE proposes (constant liar over the trials in flight)
    # instead of the Gaussian process (None: never): the auto sampler's, see towerlab.search.samplers.auto.
    tpe_after: Optional[int] = None

    @classmethod
    def shape(cls, cfg: SearchConfig, space: Space, settings: SamplerSettings) -> Shape:
        shape = super().shape(cfg, space, settings)
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

    @classmethod
    def needs(cls, cfg: SearchConfig, space: Space) -> None:
        optuna_for_gp()

    def __init__(self, cfg: SearchConfig, space: Space, rungs: int) -> None:
        super().__init__(cfg, space, rungs)
        optuna = self._optuna = optuna_for_gp()
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self._asynchronous = self.asynchronous(cfg, self.settings)
        self.startup = STARTUP if self._asynchronous else 0
        self._distributions = {name: modelled(optuna, values) for name, values in space.genes.items()}

    def propose(self, history: Sequence[Generation], in_flight: Optional[InFlight] = None,
                quickly: bool = False) -> list[dict]:
        """`population` genomes the search has not proposed before, or fewer where --max-evaluations
        leaves fewer trainings, or none where the space holds no other (`quickly`: TPE's)."""
        number = generation_number(history, in_flight)
        complete = sum(m.ok and m.rung == self.rungs - 1 for generation in history for m in generation.members)
        engine = self._engine(number, complete, quickly)
        joint = isinstance(engine, self._optuna.samplers.GPSampler)  # TPE models a conditional gene by its branch
        study = study_of(self._optuna, engine, self._distributions, self.rungs,
                         self._imputed(history) if joint else history, in_flight,
                         self._filled if joint and self.space.conditional else as_it_is)
        budget = budget_left(self.cfg, history, in_flight)
        return asked_anew(study, self.space, self._distributions, self.proposed(history, in_flight),
                          sampler_rng(self.cfg.seed, "gp", 2, number),
                          self.population if budget is None else min(self.population, budget), self._rounded)

    def propose_quickly(self, history: Sequence[Generation], in_flight: Optional[InFlight] = None) -> list[dict]:
        """TPE's proposal (constant liar over the genomes in flight) from the same inputs: a hundredth of the
        Gaussian process's time, for a worker that waits for it now."""
        return self.propose(history, in_flight, quickly=True)

    def prepare(self) -> None:
        """GPSampler's first ask imports and sets up what its fit runs on (seconds); TPE's, its quick proposals'."""
        optuna = self._optuna
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            prepared(optuna, optuna.samplers.GPSampler(seed=0, n_startup_trials=1))
            prepared(optuna, optuna.samplers.TPESampler(seed=0, n_startup_trials=1, constant_liar=True))

    def _engine(self, number: int, complete: int, quickly: bool = False) -> Any:
        """What proposes generation `number` with `complete` outcomes in hand: the Gaussian process (or, in its
        start-up, its random draws), or past `tpe_after` outcomes, or `quickly`, TPE; seeded for that
        generation alone."""
        optuna = self._optuna
        with warnings.catch_warnings():  # GPSampler and constant_liar are "experimental" in some versions
            warnings.simplefilter("ignore")
            if quickly or self.tpe_after is not None and complete >= self.tpe_after:
                return optuna.samplers.TPESampler(
                    seed=int(sampler_rng(self.cfg.seed, "gp", 1, number).integers(2**32)), constant_liar=True)
            if self._asynchronous:
                startup = MIN_OUTCOMES if number >= STARTUP else 2**31  # 2**31: never enough, a random draw
            else:
                startup = max(1, STARTUP - self.population)
            return optuna.samplers.GPSampler(seed=int(sampler_rng(self.cfg.seed, "gp", 3, number).integers(2**32)),
                                             n_startup_trials=startup,
                                             warn_independent_sampling=False)  # conditional genes: see above

    def _imputed(self, history: Sequence[Generation]) -> Sequence[Generation]:
        """`history` as the Gaussian process is told it: a member a pruned search stopped early as complete, at its
        score at the rung it reached (see the module's docstring)."""
        last = self.rungs - 1
        return [dataclasses.replace(g, members=tuple(dataclasses.replace(m, rung=last) if m.ok and m.rung < last
                                                     else m for m in g.members)) for g in history]

    def _filled(self, genome: Mapping[str, Any]) -> Mapping[str, Any]:
        """`genome` with a stand-in for each gene it lacks (inactive there), drawn from the gene's distribution by
        a stream of the genome's own: what the Gaussian process is told of a conditional space's trials, so that
        it models every gene (see the module's docstring)."""
        missing = [name for name in self.space.genes if name not in genome]
        if not missing:
            return genome
        rng = sampler_rng(self.cfg.seed, "gp stand-in", int(genome_hash(genome)[:8], 16))
        return {**genome, **{name: draw_gene(rng, self.space.genes[name]) for name in missing}}

    def _rounded(self, name: str, value: Any) -> Any:
        gene = self.space.genes[name]
        if isinstance(gene, Range) and gene.kind == "float" and gene.step is None:
            return gene.clip(float(f"{value:.{DIGITS}g}"))
        if isinstance(gene, Range) and gene.kind == "int" and not isinstance(value, int):  # a relaxed int
            return gene.clip(int(round(value)))
        return value


def modelled(optuna: Any, gene: Any) -> Any:
    """How the Gaussian process takes a gene: as `distribution` says, but an int range of more than RELAXED
    values (a batch size, a width) as a float range, its proposals rounded (`GPSampler._rounded`). Optuna
    optimises the acquisition over an int gene by a line search through its values: at LCBench's 3 (16 to
    512 and 64 to 1,024 log-scaled, 1 to 5) a proposal took 0.7 to 1.4 s of CPU, 0.15 to 0.2 s relaxed."""
    if isinstance(gene, Range) and gene.kind == "int" and gene.step is None and gene.high - gene.low + 1 > RELAXED:
        return optuna.distributions.FloatDistribution(gene.low, gene.high, log=gene.log)
    return distribution(optuna, gene)
