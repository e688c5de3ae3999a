"""A plain PyTorch + Optuna script, written as a user would, that trains a given list of MLPs on MNIST:
the baseline of bench/queue/optuna_same_work.py. Same network, optimizer, input standardisation, batch,
epochs and seeds as towerlab's candidates; one process per core sharing a JournalFileBackend study;
each genome given with `study.enqueue_trial`; then the best one retrained for its test accuracy.

    python bench/queue/plain_optuna.py --genomes genomes.json --journal study.log --data-dir ../shared/data
"""

import argparse
import json
import multiprocessing
import time

import numpy as np
import optuna
import torch
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend
from torch import nn

ACTIVATIONS = {"relu": nn.ReLU, "elu": nn.ELU, "tanh": nn.Tanh, "sigmoid": nn.Sigmoid}
LR = {"adam": 1e-3, "sgd": 1e-2}


def load(data_dir, val_size=5000):
    d = np.load(f"{data_dir}/mnist.npz")
    x, y = d["x_train"].astype(np.float32) / 255, d["y_train"].astype(np.int64)
    x_test, y_test = d["x_test"].astype(np.float32) / 255, d["y_test"].astype(np.int64)
    cut = len(x) - val_size
    mean, std = x[:cut].mean(), x[:cut].std()
    norm = lambda a: torch.from_numpy((a - mean) / std).reshape(len(a), -1)  # noqa: E731 - a user's one-liner
    return (norm(x[:cut]), torch.from_numpy(y[:cut])), (norm(x[cut:]), torch.from_numpy(y[cut:])), \
        (norm(x_test), torch.from_numpy(y_test))


def make(neurons, layers, activation="relu"):
    body, width = [], 28 * 28
    for _ in range(layers):
        body += [nn.Linear(width, neurons), ACTIVATIONS[activation](), nn.Dropout(0.2)]
        width = neurons
    return nn.Sequential(*body, nn.Linear(width, 10))


def accuracy(model, data):
    model.eval()
    with torch.no_grad():
        return (model(data[0]).argmax(1) == data[1]).float().mean().item()


def train(genome, seed, splits, epochs, batch_size):
    torch.manual_seed(seed)
    model = make(genome["neurons"], genome["layers"], genome.get("activation", "relu"))
    optimizer = getattr(torch.optim, {"adam": "Adam", "sgd": "SGD"}[genome.get("optimizer", "adam")])(
        model.parameters(), lr=genome.get("lr", LR[genome.get("optimizer", "adam")]))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*splits[0]), batch_size=batch_size,
                                         shuffle=True, generator=torch.Generator().manual_seed(seed))
    for _ in range(epochs):
        model.train()
        for xb, yb in loader:
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(xb), yb).backward()
            optimizer.step()
    return model, accuracy(model, splits[1])


def work(journal, trials, data_dir, epochs, batch_size):
    torch.set_num_threads(1)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    splits = load(data_dir)
    study = optuna.load_study(study_name="plain", storage=JournalStorage(JournalFileBackend(journal)))

    def objective(trial):
        genome = {"neurons": trial.suggest_categorical("neurons", [64, 256, 512, 1024]),
                  "layers": trial.suggest_int("layers", 1, 3),
                  "lr": trial.suggest_categorical("lr", [0.001, 0.003])}
        return train(genome, trial.user_attrs["seed"], splits, epochs, batch_size)[1]

    study.optimize(objective, n_trials=trials)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--genomes", required=True, help="JSON list of {genome, seed}")
    parser.add_argument("--journal", required=True)
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=128)
    args = parser.parse_args()
    started = time.perf_counter()
    genomes = json.load(open(args.genomes))
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(study_name="plain", direction="maximize",
                                storage=JournalStorage(JournalFileBackend(args.journal)))
    for g in genomes:
        study.enqueue_trial(g["genome"], user_attrs={"seed": g["seed"]})
    share = [len(genomes) // args.processes + (i < len(genomes) % args.processes) for i in range(args.processes)]
    workers = [multiprocessing.get_context("spawn").Process(
        target=work, args=(args.journal, n, args.data_dir, args.epochs, args.batch_size)) for n in share]
    for p in workers:
        p.start()
    for p in workers:
        p.join()
    best = study.best_trial
    torch.set_num_threads(1)
    splits = load(args.data_dir)
    model, val = train(best.params, best.user_attrs["seed"], splits, args.epochs, args.batch_size)
    print(json.dumps({"best": best.params, "val_accuracy": best.value, "retrained_val_accuracy": val,
                      "test_accuracy": accuracy(model, splits[2]), "trials": len(study.trials),
                      "seconds": time.perf_counter() - started}))


if __name__ == "__main__":
    main()
