"""`--sampler random`: genomes drawn without replacement (never one the search has proposed
before), `--population` at a time, until the space is exhausted: uniformly from a space of lists,
from each gene's distribution (`random_genome`) when a gene is a range or conditional (an inactive gene
left out). It proposes each generation
while the one before still trains (no outcome is read), so no worker waits at a generation's end."""

from __future__ import annotations

from typing import Optional, Sequence

from towerlab.config import MAX_MEMBERS
from towerlab.search.candidates import sampler_rng
from towerlab.search.history import Generation
from towerlab.search.samplers import INDEXABLE, InFlight, Sampler, generation_number, random_genome
from towerlab.search.space import genome_hash


class RandomSampler(Sampler):
    # Its proposals read no outcome: proposed with the generation before in flight, they are the same.
    overlaps = True
    can_wait_less = True

    def propose(self, history: Sequence[Generation], in_flight: Optional[InFlight] = None) -> list[dict]:
        seen = self.proposed(history, in_flight)
        size = self.space.size
        n = min(self.population, size - len(seen))
        if n <= 0:
            return []
        rng = sampler_rng(self.cfg.seed, "random", generation_number(history, in_flight))
        if size <= MAX_MEMBERS and size - len(seen) <= 4 * n:  # few left: draw among them directly
            rest = [g for g in self.space.all_genomes() if genome_hash(g) not in seen]
            return [rest[int(i)] for i in rng.choice(len(rest), size=n, replace=False)]  # type: ignore[call-overload]  # n: whole (a finite space)
        picks: dict[str, dict] = {}
        while len(picks) < n:
            genome = (self.space.genome_at(int(rng.integers(size))) if size <= INDEXABLE and not self.space.drawn_by_gene  # type: ignore[call-overload]  # whole here
                      else random_genome(rng, self.space))
            h = genome_hash(genome)
            if h not in seen:
                picks.setdefault(h, genome)
        return list(picks.values())
