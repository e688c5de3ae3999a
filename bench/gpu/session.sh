#!/usr/bin/env bash
# Every GPU measurement of issue 57 on one lent card (one H100 or H200, torch 2.11, offline), in four
# parts, one device call each, about ten minutes of commands in all. Read this header and run it.
#
# THE PLAN (device time is short: 15 minutes in all, starts and idle waits included; the machine keeps
# what the calls before left only while it stays warm, 30 s after a call: make the calls back to back)
#
# 0. Here, in the root of the checkout that the device calls send (the session's own), before any call:
#      get airbench94_muon.py from github.com/KellerJordan/cifar10-airbench (a clone, or the session's
#      fetch tool and `git --git-dir MIRROR show HEAD:airbench94_muon.py > AIRBENCH`), then
#      bash bench/gpu/session.sh prepare ../shared/data AIRBENCH
#    It fills .gpu/ (git-ignored through .git/info/exclude, never committed): mnist.npz (11 MiB), the
#    airbench94_muon.py to run unchanged (read, never committed), and cifar10.npz (162 MiB) cut in 4
#    pieces of 40.4 MiB, .gpu/cifar10.npz.0 .. .3: a call carries at most 64 MiB, the tree (~4 MiB) in it.
# 1. run  carry [".gpu/mnist.npz", ".gpu/cifar10.npz.0", ".gpu/airbench94_muon.py"]  timeout_s 200
#         command: bash bench/gpu/session.sh tests .gpu "$OUT"      pytest -m gpu, its log      ~70 s
# 2. run  carry [".gpu/cifar10.npz.1"]  timeout_s 200
#         command: bash bench/gpu/session.sh mnist .gpu "$OUT"      mnist-fast, 3 seeds         ~80 s
# 3. run  carry [".gpu/cifar10.npz.2"]  timeout_s 300
#         command: bash bench/gpu/session.sh search .gpu "$OUT"     1, 2, 4 workers per GPU, then
#         1, 4 and 16 one-epoch mlps trained one by one and stacked in one step (stacked_mlps.py)   ~120 s
# 4. run  carry [".gpu/cifar10.npz.3"]  timeout_s 600
#         command: bash bench/gpu/session.sh cifar .gpu "$OUT"      joins the 4 pieces there and checks their
#         SHA-256 (a44cc18e...c43d); airbench94_muon.py (5 runs after its warm-up) then cifar-94 (5 seeds,
#         the compiled step), beside it; 2 seeds of the graph step after, if time is left      ~420 s
#    A call that starts a fresh machine (one went cold) has lost the pieces before it: the cifar part
#    then says which are missing (exit 3, at once); carry those again, 40 MiB a call, then rerun it.
#    With under 8 minutes of device time left before call 4, run it as
#      CIFAR_RUNS=3 bash bench/gpu/session.sh cifar .gpu "$OUT"   (3 runs of each side instead of 5).
# 5. give_back. Each call's files come back as $OUT/<part>.tar.gz and $OUT/session.log: unpack them
#    here, copy the records to bench/results/ (named gpu-*-DATE.json as before, with the card, driver,
#    torch and command; pytest's log as gpu-pytest-DATE.log), regenerate the tables (bench/tables.py),
#    set the default --workers-per-device from the search figure, and commit.
#
# Each command's output goes to OUT/<name>.log, its records under OUT/results/<name>/, a line per
# command to OUT/session.log; each has a time limit, so one that hangs costs its limit and no more.
# GPU_SESSION_DRY=1 runs every part on a CPU in seconds (the benchmarks' --dry-run, cifar94.py's smoke
# budget; not the CUDA-graph diagnostic, which needs a card): what tests/test_bench.py checks;
# CIFAR10_SHA256 replaces the expected digest there.
set -u
part=${1:-} data=${2:-} out=${3:-}
here=$(cd "$(dirname "$0")/../.." && pwd)
cd "$here" || exit 2
export PYTHONPATH="$here/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python=${PYTHON:-python3}
sha=${CIFAR10_SHA256:-a44cc18e4ad961b5158c7da062a6232fb65938b615bf013046199b823b75c43d}
runs=${CIFAR_RUNS:-5}
dry=${GPU_SESSION_DRY:-}
started=$SECONDS

if [ "$part" = prepare ]; then  # here, on the machine without the card: bash bench/gpu/session.sh prepare DATA AIRBENCH [DEST]
    airbench=${3:-} dest=${4:-.gpu}
    if [ ! -f "$data/mnist.npz" ] || [ ! -f "$data/cifar10.npz" ] || [ ! -f "$airbench" ]; then
        echo "session.sh prepare: needs DATA/mnist.npz, DATA/cifar10.npz and airbench94_muon.py (got $data, $airbench)" >&2
        exit 2
    fi
    mkdir -p "$dest" && install -m 644 "$data/mnist.npz" "$airbench" "$dest/" || exit 2
    (cd "$dest" && rm -f cifar10.npz.? && split -n 4 -a 1 -d "$data/cifar10.npz" cifar10.npz.) || exit 2
    if [ "$dest" = .gpu ]; then
        exclude=$(git rev-parse --git-path info/exclude)
        grep -qx '/.gpu/' "$exclude" 2>/dev/null || echo '/.gpu/' >>"$exclude"
    fi
    ls -l "$dest"
    exit 0
fi

case $part in tests|mnist|search|cifar) ;; *)
    echo "session.sh: the part is prepare, tests, mnist, search or cifar, not '$part'" >&2
    exit 2 ;;
esac
if [ -z "$data" ] || [ -z "$out" ]; then
    echo "session.sh: usage: bash bench/gpu/session.sh $part DATA_DIR OUT" >&2
    exit 2
fi
data=$(cd "$data" && pwd) || exit 2
mkdir -p "$out/results"

step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2 begun=$SECONDS status
    shift 2
    echo "== $name: $*" >>"$out/session.log"
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    status=$?
    echo "== $name: exit $status after $((SECONDS - begun)) s" | tee -a "$out/session.log"
    tail -n 16 "$out/$name.log"
}

finish() {  # everything but the log in one file: a call brings back at most 8 files
    # written outside $out, then moved in: an archive written into the folder it reads changes that folder
    # while tar reads it, and GNU tar then exits 1 ("file changed as we read it") and nothing is cleared
    local archive
    archive=$(mktemp) &&
        tar -czf "$archive" -C "$out" --exclude "*.tar.gz" --exclude session.log . &&
        mv "$archive" "$out/$part.tar.gz" &&
        find "$out" -mindepth 1 -maxdepth 1 ! -name "$part.tar.gz" ! -name session.log -exec rm -rf {} +
    echo "== part $part: $((SECONDS - started)) s" | tee -a "$out/session.log"
}

{ nvidia-smi; "$python" -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available() and torch.cuda.get_device_name(0))"
} >"$out/machine.log" 2>&1
bench=("$python" bench/speed/run.py --suite gpu ${dry:+--dry-run} --data-dir "$data")

case $part in
tests)
    step pytest-gpu 150 "$python" -m pytest -q -m gpu -p no:cacheprovider tests ;;
mnist)
    step mnist-fast 150 "${bench[@]}" --only lenet5_tta_compiled --repeats 3 --out-dir "$out/results/mnist-fast" ;;
search)
    step search 240 "${bench[@]}" --only search --repeats 1 --out-dir "$out/results/search"
    step stacked 80 "$python" bench/gpu/stacked_mlps.py ${dry:+--dry-run} --data-dir "$data" --out-dir "$out/results/stacked" ;;
cifar)
    missing=""
    for i in 0 1 2 3; do [ -f "$data/cifar10.npz.$i" ] || missing="$missing .gpu/cifar10.npz.$i"; done
    if [ ! -f "$data/cifar10.npz" ] && [ -n "$missing" ]; then
        echo "session.sh cifar: missing on this machine:$missing (a fresh machine?): carry them again" |
            tee -a "$out/session.log"
        exit 3
    fi
    if [ ! -f "$data/cifar10.npz" ]; then
        cat "$data"/cifar10.npz.[0-3] >"$data/cifar10.npz.joined" && mv "$data/cifar10.npz.joined" "$data/cifar10.npz"
    fi
    if ! echo "$sha  $data/cifar10.npz" | sha256sum -c --quiet - >>"$out/session.log" 2>&1; then
        echo "session.sh cifar: cifar10.npz's SHA-256 is not $sha: carry the 4 pieces again" | tee -a "$out/session.log"
        rm -f "$data/cifar10.npz"
        exit 3
    fi
    smoke=(${dry:+--budget smoke})
    step cifar94 530 "$python" bench/gpu/cifar94.py "${smoke[@]}" --seeds "$runs" --airbench "$data/airbench94_muon.py" \
        --airbench-runs "$runs" --data-dir "$data" --out-dir "$out/results/cifar94"
    if [ -n "$dry" ]; then  # a CPU has no CUDA graph: the diagnostic would train cifar94's eager step again
        echo "== cifar94-graph: not run dry (no CUDA graph on a CPU)" | tee -a "$out/session.log"
    elif [ $((SECONDS - started)) -lt 450 ]; then  # a diagnostic, where time is left: the uncompiled graph step
        step cifar94-graph 90 "$python" bench/gpu/cifar94.py --seeds 2 --flags "--step graph" \
            --data-dir "$data" --out-dir "$out/results/cifar94-graph"
    fi ;;
esac
finish
