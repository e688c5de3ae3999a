"""An image folder's files: its layout, its classes, and what is skipped. Standard library only.

Two layouts, as torchvision's ImageFolder and Keras's image_dataset_from_directory read them:
`PATH/train/<class>/...` with `PATH/test/<class>/...` and `PATH/val/<class>/...` beside it where
present, or `PATH/<class>/...` alone (read as train/ alone). A class is a folder's name; the classes
are train/'s, sorted (Python's string order). Files are found at any depth inside a class folder,
following links; names beginning with a dot (.DS_Store, .ipynb_checkpoints) are not looked at.

What cannot be read as an image is skipped and counted (`Listing.skipped`), never read silently:
files of other extensions, files beside the class folders, broken links, what is not a regular
file, unreadable folders inside a class folder, and a link back to a folder it lies in (a loop).
What would change the classes is an error instead (`UserError`): no train/ beside test/ or val/, a
class folder that cannot be read or holds no image, fewer than two classes, a class of test/ or
val/ that train/ lacks.
"""

from __future__ import annotations

import functools
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, NamedTuple, Sequence

from towerlab.errors import UserError

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".gif")
SPLITS = ("train", "val", "test")  # the order of the cache's blocks
MAX_CLASSES = 1000  # as for your own .npz


class ImageFile(NamedTuple):
    """One image file: its split, its label (an index into `Listing.classes`), its path relative to the
    folder ('/'-separated) and its size. A tuple: a folder may list millions."""

    split: str
    label: int
    path: str
    size: int


@dataclass
class Listing:
    """What a folder holds: `classes` (train/'s, sorted), its class folders (`found`: (split, class,
    [(path within the class folder, size) of each image, in the order the folder
    lists them])), where each split lies in the folder (`prefixes`) and `skipped` ((path, reason) of
    every file that is not read). `splits`: the split folders present (("train",) for a folder of
    class folders)."""

    root: Path
    splits: tuple[str, ...]
    classes: tuple[str, ...]
    found: list[tuple[str, str, list[tuple[str, int]]]]
    prefixes: dict[str, str]
    skipped: list[tuple[str, str]] = field(default_factory=list)

    @functools.cached_property
    def files(self) -> list[ImageFile]:
        """Every image: train's, then val's, then test's, each split's in the order of their paths
        within their class folders, the class breaking ties."""
        label = {name: k for k, name in enumerate(self.classes)}
        files = []
        for split in self.splits:
            rows = sorted((rel, name, size) for s, name, found in self.found if s == split for rel, size in found)
            files += [ImageFile(split, label[name], f"{self.prefixes[split]}{name}/{rel}", size)
                      for rel, name, size in rows]
        return files

    def count(self, split: str) -> int:
        return sum(len(rows) for s, _, rows in self.found if s == split)


def _visible(name: str) -> bool:
    return not name.startswith(".")


def _scan(folder: str) -> list[os.DirEntry]:
    with os.scandir(folder) as entries:
        return [e for e in entries if _visible(e.name)]


def _is_dir(entry: os.DirEntry) -> bool:
    try:
        return entry.is_dir()
    except OSError:  # a link that points into a loop of links (ELOOP): not a folder to walk
        return False


def list_folder(root: str | os.PathLike) -> Listing:
    """The layout, classes and files of the image folder `root` (see the module's docstring)."""
    root = Path(root).expanduser()
    if not root.is_dir():
        raise UserError(f"image folder {root} not found: give a folder of class folders (PATH/<class>/*.jpg), "
                        "or one holding train/ and test/ (PATH/train/<class>/...)")
    try:
        top = _scan(str(root))
    except OSError as err:
        raise UserError(f"cannot read image folder {root}: {err.strerror or err}") from None
    folders = {e.name for e in top if _is_dir(e)}
    skipped: list[tuple[str, str]] = []
    if "train" in folders:
        where = {s: root / s for s in SPLITS if s in folders}
        skipped += [(e.name, "beside train/, val/ and test/") for e in top if e.name not in SPLITS]
    elif folders & {"val", "test"}:
        raise UserError(f"{root} holds {' and '.join(sorted(folders & {'val', 'test'}))}/ but no train/: put the "
                        "training images in train/<class>/, or give a folder of class folders alone")
    else:
        where = {"train": root}
    splits = tuple(where)
    found = {s: _class_folders(where[s], root, skipped) for s in splits}
    classes = tuple(sorted(found["train"]))
    _check_classes(root, classes, found, where)
    cut = len(os.path.join(str(root), ""))
    above = {split: frozenset(_identity(p) for p in {root, where[split]}) for split in splits}
    files = [(split, name, _class_files(where[split] / name, cut, skipped, above[split])) for split in splits
             for name in sorted(found[split])]
    prefixes = {split: os.path.join(str(where[split]), "")[cut:] for split in splits}
    return Listing(root, splits, classes, files, prefixes, skipped)


def _class_folders(folder: Path, root: Path, skipped: list[tuple[str, str]]) -> list[str]:
    try:
        entries = _scan(str(folder))
    except OSError as err:
        raise UserError(f"cannot read {folder}: {err.strerror or err}") from None
    skipped += [(_relative(Path(e.path), root), "not in a class folder") for e in entries if not _is_dir(e)]
    return [e.name for e in entries if _is_dir(e)]


def _check_classes(root: Path, classes: tuple[str, ...], found: dict[str, list[str]], where: dict[str, Path]) -> None:
    train = where["train"]
    if len(classes) < 2:
        what = f"one class folder ({classes[0]}/)" if classes else "no class folder"
        raise UserError(f"{train} holds {what}: a classifier needs at least 2 classes, one folder of images each "
                        f"({train}/<class>/*.jpg)")
    if len(classes) > MAX_CLASSES:
        raise UserError(f"{train} holds {len(classes)} class folders, more than {MAX_CLASSES}: is it a folder of "
                        "class folders?")
    for split, names in found.items():
        foreign = sorted(set(names) - set(classes))
        if foreign:
            raise UserError(f"{where[split]} has class folder {foreign[0]}/ that {train} lacks: every class of {split}/ "
                            "must be one the network learns from train/ (add it there, or remove it)")


def _identity(folder: Path) -> tuple[int, int]:
    info = os.stat(folder)
    return info.st_dev, info.st_ino


def _class_files(folder: Path, cut: int, skipped: list[tuple[str, str]],
                 above: frozenset[tuple[int, int]]) -> list[tuple[str, int]]:
    """`_walk` of a class folder; the paths it skips named from the image folder (`cut`: its length);
    `above`: the folders it lies in (the image folder, its split's), which a link inside it must not
    lead back to (the other classes' images would take this class's label)."""
    try:
        found = _walk(str(folder), lambda path: path[cut:], skipped, above)
    except OSError as err:
        raise UserError(f"cannot read class folder {folder}: {err.strerror or err}") from None
    if not found:
        raise UserError(f"class folder {folder} holds no image ({', '.join(IMAGE_SUFFIXES)}): add images, or remove "
                        "the folder")
    return found


def _walk(folder: str, shown: Callable[[str], str], skipped: list[tuple[str, str]],
          above: frozenset[tuple[int, int]] = frozenset()) -> list[tuple[str, int]]:
    """(path within `folder`, size) of every image file under `folder`, in the
    order the folders list them, walked depth first, following links to folders except those that lead
    back to a folder they lie in (`folder` itself, and those of `above`, the folders `folder` lies in);
    what is not read goes to `skipped`, named by `shown(its path)`. OSError where `folder` itself cannot
    be read. (Names and stats through each folder's descriptor, and the least Python a file can cost:
    the stat of every file is much of a folder's listing.)"""
    top = os.stat(folder)
    out: list[tuple[str, int]] = []
    append, stat_of, is_file = out.append, os.stat, stat.S_ISREG  # bound once: this loop runs per file
    pending = [("", above | {(top.st_dev, top.st_ino)})]
    while pending:
        prefix, ancestors = pending.pop()
        here = os.path.join(folder, prefix)
        try:
            descriptor = os.open(here, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        except OSError as err:
            if not prefix:
                raise
            skipped.append((shown(here.rstrip("/")), f"unreadable folder ({err.strerror or err})"))
            continue
        try:
            for name in os.listdir(descriptor):
                if name[0] == ".":
                    continue
                try:
                    info = stat_of(name, dir_fd=descriptor)
                except OSError as err:
                    skipped.append((shown(here + name), f"unreadable ({err.strerror or err})"))
                    continue
                if is_file(info.st_mode):
                    if name.lower().endswith(IMAGE_SUFFIXES):
                        append((prefix + name, info.st_size))
                    else:
                        skipped.append((shown(here + name),
                                        f"not an image file ({os.path.splitext(name)[1] or 'no extension'})"))
                elif stat.S_ISDIR(info.st_mode):
                    key = (info.st_dev, info.st_ino)
                    if key in ancestors:
                        skipped.append((shown(here + name), "a link back to a folder it lies in (a loop)"))
                    else:
                        pending.append((f"{prefix}{name}/", ancestors | {key}))
                else:
                    skipped.append((shown(here + name), "not a regular file"))
        finally:
            os.close(descriptor)
    return out


def image_files(inputs: Sequence[str | os.PathLike]) -> tuple[list[Path], list[tuple[str, str]]]:
    """The image files that `inputs` name (files as given; folders walked as class folders are, their
    images in file-name order), and (path, reason) of what is skipped in those folders."""
    files: list[Path] = []
    skipped: list[tuple[str, str]] = []
    for given in inputs:
        path = Path(given).expanduser()
        if path.is_dir():
            try:
                files += [path / found[0] for found in sorted(_walk(str(path), str, skipped))]
            except OSError as err:
                raise UserError(f"cannot read folder {path}: {err.strerror or err}") from None
        elif path.exists() or path.is_symlink():
            files.append(path)
        else:
            raise UserError(f"no file or folder {path}: give image files (JPEG, PNG, BMP, WebP, GIF) or folders of them")
    return files, skipped


def _relative(path: Path, root: Path) -> str:
    return path.relative_to(root).as_posix()
