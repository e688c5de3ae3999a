"""The benchmark's own plumbing (its figures are measured by bench/, never asserted here)."""

import subprocess
import sys

import pytest

from util import REPO


def _bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "bench" / "run.py"), *args], capture_output=True, text=True,
                          cwd=REPO, timeout=120)


@pytest.mark.parametrize("suite, group", [("cpu", "mnist_tta"), ("gpu", "lenet5_tta"), ("gpu", "search")])
def test_a_figure_group_needs_only_the_data_it_reads(suite, group, tmp_path):
    (tmp_path / "mnist.npz").write_bytes(b"")  # the dry run only checks that the file is there
    done = _bench("--suite", suite, "--only", group, "--dry-run", "--data-dir", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "all accepted by towerlab's parser" in done.stdout


def test_a_group_whose_data_is_missing_is_refused_naming_the_file(tmp_path):
    (tmp_path / "mnist.npz").write_bytes(b"")
    done = _bench("--suite", "gpu", "--only", "lenet5_tta", "cifarnet_tta", "--dry-run", "--data-dir", str(tmp_path))
    assert done.returncode == 2
    assert "cifar10.npz not found" in done.stderr and "cifarnet_tta" in done.stderr and "lenet5_tta" not in done.stderr
