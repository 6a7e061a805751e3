"""Compact run records: rewrite, in place, the records written before histories were compact or compressed.

A run's record (named ``<name>.json`` in a study's folder) keeps its per-step history as columns (``{"step": [...],
key: [...]}``) of the keys its study's readers read (:data:`benchmarks.common.RECORD_KEYS`), each float to six
significant digits, as one line of JSON, gzip-compressed as ``<name>.json.gz`` (:func:`benchmarks.common.save_run`);
everything else in the record stays as it was. Records written before 0.7 held one dict per step with ~30 keys at
full precision, seven times the size; records written before 0.8 were not compressed (five times the size). Readers
see the same rows either way (:func:`benchmarks.common.load_runs`), and a converted record converts to the same bytes,
so this can run again whenever old records arrive (a run started at an older commit):

    python -m benchmarks.compact_records                                         # every record under docs/benchmarks
    python -m benchmarks.compact_records docs/benchmarks/smollm2_staleness/attempt2/arms        # one folder

A record's study is its folder under ``--root`` (``docs/benchmarks/reuse_lm/epochs_seeds/...`` is ``reuse_lm``).
Records of a study with no kept keys stop the run in one line, unless they are compact already (a study whose own
writer chose its keys, such as ``adaptive_reuse``): those are left as they are.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.common import (
    ANSWERS_SUFFIX,
    RECORD_GZ,
    RECORD_KEYS,
    compact_history,
    read_record_text,
    record_json,
    stored_record,
    write_record_text,
)

ROOT = Path("docs/benchmarks")


def logged_keys(history) -> list[str]:
    """Every key a history holds, in the order first logged (rows) or stored (columns): what a record of a study
    that nothing reads any more keeps (``archive/``)."""
    keys = list(history) if isinstance(history, dict) else list(dict.fromkeys(k for h in history for k in h))
    return [k for k in keys if k != "step"]


def compact_record(record: dict, keys) -> dict:
    """``record`` with its history as :func:`~benchmarks.common.compact_history` of ``keys`` (None: every logged key),
    every other field as it was and where it was."""
    history = record["history"]
    return {**record, "history": compact_history(history, logged_keys(history) if keys is None else keys)}


def study_of(path: Path, root: Path) -> str:
    """The study a record belongs to: its first folder under ``root``."""
    try:
        return path.resolve().relative_to(root.resolve()).parts[0]
    except ValueError:
        raise SystemExit(f"{path} is not under --root {root}, so its study (its folder there) is unknown") from None


def record_files(paths: list[Path]) -> list[Path]:
    """The JSON files of ``paths`` (files, or folders searched throughout), plain or compressed, sorted, each once."""
    found = set()
    for path in paths:
        if not path.exists():
            raise SystemExit(f"{path} does not exist")
        if path.is_file():
            found.add(path)
        else:
            found.update(path.rglob("*.json"))
            found.update(p for p in path.rglob("*.json" + RECORD_GZ) if not p.name.endswith(ANSWERS_SUFFIX))
    return sorted(found)


def convert(path: Path, root: Path) -> tuple[int, int, bool] | None:
    """Rewrites the record at ``path`` compact and compressed if it is not (a converted record is left untouched);
    returns the bytes it took on disk before and after and whether it was rewritten, or None when ``path`` holds no
    run record (a summary). A study whose own writer chose its history's keys keeps them."""
    text = read_record_text(path)
    record = json.loads(text)
    if not isinstance(record, dict) or "history" not in record:
        return None
    study = study_of(path, root)
    if study in RECORD_KEYS:
        compact = record_json(compact_record(record, RECORD_KEYS[study]))
    elif isinstance(record["history"], dict):
        compact = text  # compact already, with the keys its writer chose
    else:
        raise SystemExit(f"{path}: no kept history keys for study {study!r} (benchmarks.common.RECORD_KEYS)")
    before = path.stat().st_size
    rewritten = compact != text or not path.name.endswith(RECORD_GZ)
    if rewritten:
        path = write_record_text(path, compact)
    return before, stored_record(path).stat().st_size, rewritten


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("paths", nargs="*", type=Path, default=[ROOT], help="Records or folders of records (default: all).")
    p.add_argument("--root", type=Path, default=ROOT, help="The folder holding one folder per study.")
    args = p.parse_args(argv)
    sizes = {}
    for path in record_files(args.paths):
        size = convert(path, args.root)
        if size is not None:
            sizes[str(path)] = size
    before, after = sum(s[0] for s in sizes.values()), sum(s[1] for s in sizes.values())
    rewritten = sum(s[2] for s in sizes.values())
    print(f"{len(sizes)} records, {rewritten} rewritten: {before / 1e6:.1f} MB -> {after / 1e6:.1f} MB")
    return sizes


if __name__ == "__main__":
    main()
