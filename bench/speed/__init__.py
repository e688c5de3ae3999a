"""Training speed on CPUs: `run.py --suite cpu` (the figures of `suite.py`: time to accuracy against the
plain PyTorch loop of `baseline.py`, scaling, the strategies, input modes, search throughput; the before and
after of each speed change, `changes.py`; the 2-process step split, `ddp_overhead.py`), and the scripts of
one question each: OpenMP's waiting (`omp_wait.py`), the command line's start (`startup.py`), image folders
(`image_folder.py`), the seeds' examples (`seed_examples.py`). `run.py --suite gpu` runs bench/gpu's suite."""
