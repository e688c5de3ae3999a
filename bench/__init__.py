"""towerlab's benchmarks: scripts that measure, never tests (nothing here asserts a wall-clock time).

One folder per family, each with its harness; the helpers they share in one place:

    common/    what every family uses: the machine and its load (machine), one timed sample and the
               statistics of a comparison (measure), the one record writer and the records' folder (record)
    speed/     training speed: the CPU suite (run.py) and its parts, against the plain PyTorch loop
    gpu/       the same on one GPU: the GPU suite's figures, a step timed in each mode, cifar-94 beside
               airbench94_muon, stacked mlps, and the session script of a lent card
    quality/   search quality: samplers and pruning side by side, picks retrained, LCBench
    queue/     the store as the queue: tasks a second beside Optuna, kills, a trial's overhead, busy workers
    proof/     what proving what runs costs: the code, the data, a worker's start

Records go to bench/results/<family>/ (bench.common.record), which bench/tables.py, the docs and the
tests read. A script runs as a file from the repository's root (`python bench/speed/run.py --suite cpu`)
and imports its helpers as `bench.<family>.<module>`; it imports nothing from tests/ and no private
(underscore) name of towerlab (tests/test_layout.py holds both).
"""
