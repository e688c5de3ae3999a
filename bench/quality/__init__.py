"""Search quality: the samplers side by side on one budget (`samplers.py`), early pruning against the
unpruned GA (`pruning.py`), picks trained again with fresh seeds (`retrain.py`, `threads.py`), the original's
headline (`search_headline.py`), what those share (`search_runs.py`), and LCBench, a published benchmark
(`lcbench.py` over `lcbench_problem.py` and `lcbench_arms.py`; `lcbench_gp.py`, `lcbench_parallel.py`), and
rbv2_xgboost, a mixed, conditional space (`rbv2_xgboost.py` over `rbv2_problem.py`, `rbv2_arms.py` and the
space `rbv2_xgboost.toml`); the anchors both run from SMAC3 and HEBO (`anchors.py`)."""
