"""A saved model at work: `towerlab evaluate RUN_DIR` scores it on a dataset's split, `towerlab
predict RUN_DIR images.npz` labels images. Both read `model.pt` through `load_model`, whose
Classifier normalises raw uint8 images as the training did, so a run's own test split gives back
the test accuracy the run recorded.

Named scoring, not evaluation: `train.loss_and_accuracy` measures a network on a split during
training, and a search's evaluation is a candidate's training (towerlab.search.candidates); here a
finished run's model is scored (`score_run`), or labels images (`predict_file`).
"""

from __future__ import annotations

import csv
import io
import os
from pathlib import Path
from typing import Any, Callable, TypeVar

import numpy as np
import torch
import torch.nn.functional as F

from towerlab import atomic
from towerlab.config import CUSTOM_MODEL, RunConfig, TrainConfig
from towerlab.checks import is_image_folder
from towerlab.fields import from_dict, replace
from towerlab.errors import UserError
from towerlab.jobs.provenance import read_config
from towerlab.report import discard_line, printable
from towerlab.data.digest import content_digest
from towerlab.data.load import DataGiven, Dataset
from towerlab.models.classifier import Classifier
from towerlab.models.custom import NetworkSource, user_code_failed
from towerlab.models.files import load_model
from towerlab.data.readers import labels_as_int64, npz_arrays

T = TypeVar("T")

SPLITS = ("test", "val")
IMAGE_KEYS = ("x", "images", "x_test")
LABEL_KEYS = ("y", "labels", "y_test")
PREDICTIONS = "predictions"  # the folder of a run where predict writes an image's predictions by default


def model_file(path: str | os.PathLike) -> Path:
    """A run's (or an exported search's) model.pt: the folder holding it, or the file itself."""
    path = Path(path)
    if path.is_dir():
        if not (path / "model.pt").is_file():
            raise UserError(f"{path} holds no model.pt: give a finished run's folder (a search's needs --export-best)")
        return path / "model.pt"
    if not path.exists():
        raise UserError(f"{path} does not exist: give a run's folder or its model.pt")
    return path


def score_run(path: str | os.PathLike, data: DataGiven = None, *, split: str = "test", data_dir: str | None = None,
             module: NetworkSource | None = None, log: Callable[[str], None] | None = None) -> dict:
    """Score the model of run `path` on `split` of `data`: by default the dataset it was trained on,
    found as the run found it; a dataset name, .npz path or image folder (read at the model's image
    size and channels, labelled by its class names); or (images, labels) arrays (`split` then does
    not apply). Returns {"dataset", "split", "n", "accuracy", "loss", "per_class"} (per_class: each
    class's {"class" (its name), "n", "accuracy"}), and "recorded", the run's own figure for that
    split of that very data, where it has one."""
    from towerlab.data.folders import FolderOptions
    from towerlab.jobs.train import train_data

    if split not in SPLITS:
        raise UserError(f"unknown split {split!r}: choose one of {', '.join(SPLITS)}")
    file = model_file(path)
    model, record = load_model(file, module=module)
    dataset = None
    if data is not None and not isinstance(data, (str, os.PathLike)):
        x, y = _pair(data)
        name, split = "arrays", "given"
    else:
        cfg = _trained_on(record, file)
        if data is not None:
            folder = is_image_folder(os.fspath(data))
            cfg = replace(cfg, dataset=os.fspath(data), **({} if folder else {"image_size": None, "test_size": None}))
        stored = read_config(file.parent) or {}
        run = RunConfig(data_dir=data_dir if data_dir is not None else stored.get("run", {}).get("data_dir"))
        channels, height, width = model.input_shape
        reading = FolderOptions((height, width), cfg.test_size, channels, model.class_names)
        dataset = train_data(cfg, run, log=log or discard_line, folder=reading)
        x, y = (dataset.x_test, dataset.y_test) if split == "test" else (dataset.x_val, dataset.y_val)
        name = cfg.dataset
    if len(x) == 0:
        raise UserError(f"{name} has no {split} images to evaluate on")
    logits = _of_yours(record, model, lambda: model.logits(x))
    labels = torch.as_tensor(np.asarray(y)).long()
    right = logits.argmax(1) == labels
    per_class = [{"class": model.class_names[k], "n": int((labels == k).sum()),
                  "accuracy": float(right[labels == k].double().mean())}
                 for k in range(model.num_classes) if (labels == k).any()]
    result = {"dataset": name, "split": split, "n": len(labels), "accuracy": float(right.double().mean()),
              "loss": float(F.cross_entropy(logits, labels)), "per_class": per_class}
    recorded = _recorded(file.parent, dataset, split)
    if recorded is not None:
        result["recorded"] = recorded
    return result


def _of_yours(record: dict, model: Classifier, compute: Callable[[], T]) -> T:
    """`compute()`, the network's forward over the images; an error raised there by a network of
    your own (model.pt's model "custom") is one line naming where, not a traceback."""
    try:
        return compute()
    except UserError:
        raise
    except (Exception, SystemExit) as exc:  # whatever your forward raises: our bug above, yours one line
        if record.get("name") != CUSTOM_MODEL:
            raise  # a built-in network's failure is our bug: its traceback
        raise user_code_failed(exc, type(model.network), "on the images") from None


def _trained_on(record: dict, file: Path) -> TrainConfig:
    try:
        return from_dict(TrainConfig, record["config"])
    except (KeyError, TypeError, UserError):
        raise UserError(f"{file} does not record the config it was trained with: name the data (--dataset)") from None


def _recorded(folder: Path, dataset: Dataset | None, split: str) -> float | None:
    """The run's own accuracy on `split`, where it was measured on the very data read now: arrays of the
    same digest (`towerlab.data.digest`; not the fallback's digits for a run on real MNIST)."""
    summary = read_config(folder, "summary.json") or {}
    if dataset is None or "data_digest" not in summary or summary["data_digest"] != content_digest(dataset):
        return None
    value = summary.get("test_accuracy" if split == "test" else "val_accuracy")
    return value if isinstance(value, float) else None


def _pair(data: Any) -> tuple[Any, Any]:
    if not isinstance(data, (tuple, list)) or len(data) != 2:
        raise UserError("data to evaluate on must be a dataset name, an .npz path, or a pair (images, labels)")
    images, labels = data
    return images, labels


def read_images(path: str | os.PathLike) -> tuple[np.ndarray, np.ndarray | None, str, str | None]:
    """(images, labels or None, the images' key, the labels' key) from an .npz: images under
    x, images or x_test; labels, if any, under y, labels or y_test. Read as training reads its
    data (`readers.npz_arrays`): every size a header claims is checked before anything is allocated."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"no file {path}")
    arrays = npz_arrays(path, (*IMAGE_KEYS, *LABEL_KEYS), required=False)
    image_key = next((k for k in IMAGE_KEYS if k in arrays), None)
    label_key = next((k for k in LABEL_KEYS if k in arrays), None)
    if image_key is None:
        raise UserError(f"{path} holds no images: name the array x (or images, x_test)")
    return arrays[image_key], arrays[label_key] if label_key else None, image_key, label_key


def _predictions_path(out: str | os.PathLike | None, images_path: str | os.PathLike) -> Path:
    """Where predict writes: `out`, or <images stem>-predictions.npz beside the images or, where `out`
    is a folder (it exists as one, or its name ends in a slash), in that folder."""
    name = f"{Path(images_path).stem}-predictions.npz"
    if out is None:
        return Path(images_path).with_name(name)
    if str(out).endswith(("/", os.sep)) and not Path(out).is_dir():
        raise UserError(f"--out {out} names a folder that does not exist: make it first, or give a file name")
    return Path(out) / name if Path(out).is_dir() else Path(out)


def predict_file(path: str | os.PathLike, images_path: str | os.PathLike, out: str | os.PathLike | None = None,
                 *, module: NetworkSource | None = None) -> dict:
    """Label the images of `images_path` with the model of run `path`; writes `out` (default
    <images stem>-predictions.npz beside the images, or in `out` when it is a folder) holding `predictions`
    (N,) and `probabilities` (N, classes). Returns {"out", "n", "accuracy" (None without labels), ...}."""
    file = model_file(path)
    out = _predictions_path(out, images_path)
    atomic.refuse_overwriting(out, (file, images_path), (file.parent,))
    model, record = load_model(file, module=module)
    images, labels, image_key, label_key = read_images(images_path)
    probabilities = _of_yours(record, model, lambda: model.predict_proba(images))
    predictions = probabilities.argmax(1)
    accuracy = None
    if labels is not None:
        truth = labels_as_int64(labels, f"{images_path}:{label_key}", model.num_classes)
        if len(truth) != len(predictions):
            raise UserError(f"{images_path}: {len(predictions)} images but {len(truth)} labels")
        accuracy = float((predictions == truth).mean())
    buffer = io.BytesIO()
    np.savez(buffer, predictions=predictions.astype(np.int64), probabilities=probabilities.astype(np.float32))
    atomic.write_bytes(out, buffer.getvalue())
    return {"out": str(out), "n": len(predictions), "accuracy": accuracy, "images": image_key, "labels": label_key}


def _images_out(out: str | os.PathLike | None, first: str | os.PathLike, run: Path) -> Path:
    """Where predict writes an image's or a folder's predictions: `out` (a file: .json for JSON, else
    CSV; or a folder), else <name of the first input>-predictions.csv in the folder `predictions` of the
    run `run` (never beside the images: a CSV in a class folder would be skipped by the next training,
    and a run's folder is no image folder)."""
    name = f"{Path(os.path.normpath(first)).stem}-predictions.csv"
    if out is None:
        try:
            (run / PREDICTIONS).mkdir(exist_ok=True)
        except OSError as err:
            raise UserError(f"cannot write {run / PREDICTIONS} ({err.strerror or err}): pass --out FILE") from None
        return run / PREDICTIONS / name
    if str(out).endswith(("/", os.sep)) and not Path(out).is_dir():
        raise UserError(f"--out {out} names a folder that does not exist: make it first, or give a file name")
    return Path(out) / name if Path(out).is_dir() else Path(out)


def predict_images(path: str | os.PathLike, inputs: list[str], out: str | os.PathLike | None = None, *,
                   module: NetworkSource | None = None,
                   say: Callable[[str], None] | None = None) -> dict:
    """Label image files and the images of folders (`inputs`) with the model of run `path`: each is
    decoded at the model's size and channels by the rule its training read its images with
    (towerlab.data.folder_decode), and gets the class name (and probability) the model gives it
    most; `say(line)` for each image as it is labelled. Writes `out` (CSV, or JSON where it ends in
    .json; default: in the run's folder `predictions`) and returns {"out", "n", "skipped", "rows"}; a file that
    cannot be decoded is skipped and counted, and none at all is an error."""
    from towerlab.data.folder_decode import decode_many, parallel
    from towerlab.data.folder_files import image_files

    file = model_file(path)
    out = _images_out(out, inputs[0], file.parent)
    atomic.refuse_overwriting(out, (file, *inputs), (file.parent,))
    model, record = load_model(file, module=module)
    paths, skipped = image_files(inputs)
    channels, height, width = model.input_shape
    rows = []
    for chunk, images in parallel(decode_many, [str(p) for p in paths], ((height, width), channels)):
        good = [(p, image) for p, image in zip(chunk, images) if not isinstance(image, str)]
        skipped += [(p, image) for p, image in zip(chunk, images) if isinstance(image, str)]
        if not good:
            continue
        batch = np.stack([image for _, image in good])
        probabilities = _of_yours(record, model, lambda: model.predict_proba(batch))
        for (p, _), row in zip(good, probabilities):
            best = int(row.argmax())
            rows.append({"path": str(p), "class": model.class_names[best], "probability": float(row[best]),
                         "probabilities": [float(v) for v in row]})
            if say is not None:
                say(f"{printable(p)}\t{printable(model.class_names[best])}\t{row[best]:.4f}")
    if not rows:
        raise UserError(f"no image among {', '.join(map(str, inputs))} could be decoded"
                        + (f" ({skipped[0][0]}: {skipped[0][1]})" if skipped else ""))
    atomic.write_text(out, _predictions_text(out, rows, model.class_names, skipped))
    return {"out": str(out), "n": len(rows), "skipped": skipped, "rows": rows}


def _predictions_text(out: Path, rows: list[dict], classes: tuple[str, ...], skipped: list) -> str:
    if out.suffix.lower() == ".json":
        return atomic.json_text({"classes": list(classes), "predictions": rows,
                                 "skipped": [list(pair) for pair in skipped]}, indent=2) + "\n"
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow(["path", "class", "probability", *(f"p_{name}" for name in classes)])
    for row in rows:
        writer.writerow([row["path"], row["class"], f"{row['probability']:.6f}",
                         *(f"{v:.6f}" for v in row["probabilities"])])
    return text.getvalue()
