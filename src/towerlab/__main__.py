from towerlab.cli import main
from towerlab.distributed.env import torchrun_variables_set

status = main()
if torchrun_variables_set():
    # A torchrun worker leaves as towerlab's own workers do (`distributed.launch.leave`): without the
    # interpreter's teardown, which may destroy gloo's native threads while they still run and abort
    # a finished worker (SIGABRT, "terminate called without an active exception"): torchrun then
    # reports the node as failed and the other node's agent waits at its exit barrier.
    from towerlab.distributed.launch import leave

    leave(status)
raise SystemExit(status)
