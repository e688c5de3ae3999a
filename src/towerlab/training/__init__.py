"""Training: the loop (loop.py: train, evaluation, divergence), the step it drives (step.py and the
step program), how gradients meet (strategies.py), optimizers and schedules (optim.py), minibatches
(batches.py), Lookahead (lookahead.py) and checkpoints (checkpoint.py). No argv, no process spawning:
the jobs (towerlab.jobs) place each process in its group and hand it its data.
Nothing is re-exported here: import from the module.
"""
