"""MkDocs hook: the benchmark records become files of the site.

The pages link to records as `../bench/results/NAME`, which works on GitHub and in an editor but
lies outside docs/. Here each record is added to the site as `records/NAME` and the links are
pointed there, so that `mkdocs build --strict` also fails on a link to a record that does not exist.
"""

from pathlib import Path

from mkdocs.structure.files import File

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
SHIPPED = {".json", ".png", ".log"}
UNSHIPPED_FOLDERS = {"quick", "search-runs", "sampler-runs", "pruning-runs", "lcbench-runs", "rbv2-runs"}  # runs' folders, git-ignored


def on_files(files, config):
    for path in sorted(RESULTS.rglob("*")):
        relative = path.relative_to(RESULTS)
        if path.suffix in SHIPPED and not UNSHIPPED_FOLDERS & set(relative.parts):
            files.append(File.generated(config, f"records/{relative.as_posix()}", abs_src_path=str(path)))
    return files


def on_page_markdown(markdown, page, config, files):
    return markdown.replace("](../bench/results/", "](records/")
