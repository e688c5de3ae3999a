"""Speed on one GPU: the GPU suite's figures (`suite.py`, run by `bench/speed/run.py --suite gpu`), one
training step timed in each `--step` mode (`step.py`), `--preset cifar-94` beside airbench94_muon
(`cifar94.py`), mlps stacked in one step (`stacked_mlps.py`, over `stacked.py`), and the session a lent
card runs (`session.sh`)."""
