"""towerlab: synchronous data-parallel ConvNet training and genetic network search."""

import os

from towerlab.proof.package import install_package

# towerlab's own modules run from the bytes its code digest is of (`towerlab.proof.package.package_proof`): every
# module imported from here on, never from a stale .pyc.
install_package(__name__, os.path.dirname(__file__))

# OpenMP's idle threads spin-wait by default (GNU libgomp: some 300,000 spins before they sleep). On
# a CPU where another job holds a core, a spinning thread burns the time slice its partner needs:
# mnist-fast with 2 threads took 3.95x its quiet time while one core was taken, 1.47x with passive
# waiting, which costs 1.33x on a quiet machine (docs/benchmarks.md, "A busy core"). libgomp reads this
# once, when torch loads it, so it is set here, before towerlab imports torch; a value you set wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
