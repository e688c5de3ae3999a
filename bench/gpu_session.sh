#!/usr/bin/env bash
# The GPU checks of one lent card, in three parts (a machine that receives the data in pieces runs
# the MNIST part while the CIFAR-10 file is still on its way):
#
#   bash bench/gpu_session.sh mnist DATA_DIR OUT             # pytest -m gpu; mnist-fast, graph and
#                                                            # compiled step (3 seeds); LeNet-5's step
#   bash bench/gpu_session.sh cifar DATA_DIR OUT [AIRBENCH]  # cifar-94 (5 seeds), beside
#                                                            # airbench94_muon.py when its path is given
#   bash bench/gpu_session.sh search DATA_DIR OUT            # 3-generation searches, 1, 2, 4 per GPU
#
# Each command's output goes to OUT/<name>.log, its records under OUT/results/<name>/, and a line
# per command to OUT/session.log. Each command has a time limit, so one that hangs costs its limit and
# no more; the part ends with OUT/<part>.tar.gz holding all of it.
set -u
part=$1 data=$2 out=$3 airbench=${4:-}
mkdir -p "$out/results"
export PYTHONUNBUFFERED=1

step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2 started=$SECONDS status
    shift 2
    echo "== $name: $*" >>"$out/session.log"
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    status=$?
    echo "== $name: exit $status after $((SECONDS - started)) s" | tee -a "$out/session.log"
    tail -n 14 "$out/$name.log"
}

{ nvidia-smi; python3 -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))"
} >"$out/machine.log" 2>&1
case $part in
mnist)
    step pytest-gpu 100 python3 -m pytest -q -m gpu -p no:cacheprovider tests
    step mnist-fast 180 python3 bench/run.py --suite gpu --only lenet5_tta lenet5_tta_compiled --repeats 3 \
        --data-dir "$data" --out-dir "$out/results/mnist-fast"
    step step-lenet5 80 python3 bench/step_gpu.py --only lenet5-b512-mnist-fast --json "$out/results/step-lenet5.json" ;;
search)
    step search 200 python3 bench/run.py --suite gpu --only search --repeats 1 --data-dir "$data" \
        --out-dir "$out/results/search" ;;
cifar)
    step cifar94 480 python3 bench/cifar94.py ${airbench:+--airbench "$airbench"} --data-dir "$data" \
        --out-dir "$out/results/cifar94" ;;
*)
    echo "gpu_session.sh: the part is mnist, search or cifar, not $part" >&2
    exit 2 ;;
esac
tar -czf "$out/$part.tar.gz" -C "$out" --exclude "*.tar.gz" .
