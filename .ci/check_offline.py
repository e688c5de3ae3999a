"""CI: check what the README's main job did offline (see .ci/run).

    python .ci/check_offline.py fallback FOLDER STATUS   # no data folder named: the offline fallback
    python .ci/check_offline.py named FOLDER STATUS      # $TOWERLAB_DATA named FOLDER/data: an error

FOLDER holds `stderr` (the job's) and `run/` (its --out); the empty data folder the failed download
must not leave behind is FOLDER/cache/towerlab (fallback: the default one, under XDG_CACHE_HOME) or
FOLDER/data (named); STATUS is the job's exit status.
"""

import json
import sys
from pathlib import Path


def fallback(folder: Path, status: int, stderr: str) -> list[str]:
    problems = []
    if status != 0:
        problems.append(f"exit status {status}, expected 0")
    banners = stderr.count("Using the OFFLINE FALLBACK")
    if banners != 1:
        problems.append(f"the fallback banner appears {banners} times on stderr, expected once")
    if "towerlab: error" in stderr or "Traceback" in stderr:
        problems.append("an error on stderr")
    summary = folder / "run" / "summary.json"
    record = json.loads(summary.read_text()) if summary.exists() else {}
    if record.get("data_fallback") is not True:
        problems.append(f"{summary}: data_fallback is {record.get('data_fallback')!r}, expected true")
    if record.get("world_size") != 2:
        problems.append(f"{summary}: world_size {record.get('world_size')!r}, expected 2 replicas")
    return problems + left_behind(folder / "cache" / "towerlab")


def named(folder: Path, status: int, stderr: str) -> list[str]:
    problems = []
    if status != 2:
        problems.append(f"exit status {status}, expected 2")
    errors = [line for line in stderr.splitlines() if line.startswith("towerlab: error: ")]
    if len(errors) != 1 or "$TOWERLAB_DATA names that folder, so the offline fallback is not used" not in errors[0]:
        problems.append(f"{len(errors)} error line(s) on stderr, expected one refusing the fallback")
    if "OFFLINE FALLBACK" in stderr or "Traceback" in stderr:
        problems.append("the fallback or a traceback on stderr")
    if (folder / "run").exists():
        problems.append(f"the refused job left {folder / 'run'} behind")
    return problems + left_behind(folder / "data")


def left_behind(data: Path) -> list[str]:
    return [f"the failed download left {data} behind"] if data.exists() else []


if __name__ == "__main__":
    check, folder, status = {"fallback": fallback, "named": named}[sys.argv[1]], Path(sys.argv[2]), int(sys.argv[3])
    stderr = (folder / "stderr").read_text()
    found = check(folder, status, stderr)
    for problem in found:
        print(f"check_offline: {problem}", file=sys.stderr)
    if found:
        print(stderr, file=sys.stderr)
    elif check is fallback:
        print("check_offline: the offline main job, naming no data folder, fell back loudly, recorded it and exited 0")
    else:
        print("check_offline: the offline main job, naming an empty data folder, was refused in one line (exit 2)")
    sys.exit(1 if found else 0)
