"""CI: check what the README's main job did offline (see .ci/run).

    python .ci/check_offline.py FOLDER STATUS

FOLDER holds `stderr` (the job's), `run/` (its --out) and `data/` (its empty data folder, which
the failed download must not leave behind); STATUS is the job's exit status.
"""

import json
import sys
from pathlib import Path


def main(folder: Path, status: int) -> list[str]:
    stderr = (folder / "stderr").read_text()
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
    if (folder / "data").exists():
        problems.append(f"the failed download left {folder / 'data'} behind")
    return problems


if __name__ == "__main__":
    found = main(Path(sys.argv[1]), int(sys.argv[2]))
    for problem in found:
        print(f"check_offline: {problem}", file=sys.stderr)
    if found:
        print((Path(sys.argv[1]) / "stderr").read_text(), file=sys.stderr)
    else:
        print("check_offline: the offline main job fell back loudly, recorded it and exited 0")
    sys.exit(1 if found else 0)
