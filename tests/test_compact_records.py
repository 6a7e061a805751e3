"""Run records at their compact size (benchmarks/compact_records.py): an old record converts to columns of its study's
kept keys at six significant digits, stored compressed, reads back as rows, and converts to the same bytes a second
time."""

import gzip
import json
import math

import pytest

from benchmarks import compact_records
from benchmarks.common import REUSE_LM_KEYS, load_run, load_runs, read_record_text, save_run, stored_record

KEPT, DROPPED = "grad_norm", "starvation/clip_grad_throughput/pos"  # a reuse_lm key its readers read, one nobody reads


def old_record(name="dense-respo-R4-seed0") -> dict:
    """A record as reuse_lm wrote it before 0.7: one dict per step, every key at full precision, None where the trainer
    logged no value, whole numbers as floats."""
    history = [
        {"step": s, KEPT: math.pi * s / 7, DROPPED: 1 / (s + 2), "reuse/pass": float((s - 1) % 4 + 1),
         "starvation/grad_throughput/pos": None if s == 2 else -1e-9 / (3 * s), "learning_rate": 3e-5 * s / 9,
         "offpolicy/kl": 0.0, **({"reuse/grad_norm_vs_fresh": 0.1234567891} if s % 4 != 1 else {})}
        for s in range(1, 9)
    ]  # fmt: skip
    return {"name": name, "after": 0.7100000000000001, "early": {"ess": 0.98765432101}, "history": history,
            "wall_s": 12.3456789}  # fmt: skip


def write_old(folder, record) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{record['name']}.json").write_text(json.dumps(record))  # as reuse_lm wrote it


def test_conversion_keeps_every_kept_key_to_six_digits_and_converts_to_the_same_bytes_again(tmp_path):
    root = tmp_path / "docs" / "benchmarks"
    arms = root / "reuse_lm" / "epochs" / "arms"
    old = old_record()
    write_old(arms, old)
    (arms / "summary.json").write_text(json.dumps({"arms": {"x": 1}}, indent=1))  # not a record: left as it is
    summary = (arms / "summary.json").read_text()

    path = arms / "dense-respo-R4-seed0.json"
    sizes = compact_records.main([str(root), "--root", str(root)])
    assert list(sizes) == [str(path)] and sizes[str(path)][2]  # the summary is no record; the record was rewritten
    stored_file = stored_record(path)
    assert not path.exists() and stored_file.name == "dense-respo-R4-seed0.json.gz"  # one file per record: compressed
    text = gzip.decompress(stored_file.read_bytes()).decode()
    assert text == read_record_text(path) and sizes[str(path)][1] == stored_file.stat().st_size < len(text)
    assert "\n" not in text and ", " not in text  # one line, no spaces
    stored = json.loads(text)
    assert {k: v for k, v in stored.items() if k != "history"} == {k: v for k, v in old.items() if k != "history"}
    assert list(stored) == list(old)  # every other field kept, in its place
    assert DROPPED not in stored["history"] and set(stored["history"]) <= {"step", *REUSE_LM_KEYS}

    rows = load_run(path)["history"]
    assert [h["step"] for h in rows] == [h["step"] for h in old["history"]]
    for new, was in zip(rows, old["history"]):
        kept = {k: v for k, v in was.items() if k in REUSE_LM_KEYS and v is not None}
        assert set(new) == {"step", *kept}  # a value logged as None reads as not logged, as the readers treat it
        for key, value in kept.items():
            assert new[key] == float(f"{value:.6g}") and math.isclose(new[key], value, rel_tol=5e-6), key
    assert rows[0]["reuse/pass"] == 1.0 and rows[0]["offpolicy/kl"] == 0.0  # whole numbers and zero exact

    compressed = stored_file.read_bytes()
    again = compact_records.main([str(root), "--root", str(root)])
    assert not again[str(stored_file)][2] and stored_file.read_bytes() == compressed  # idempotent: nothing rewritten
    assert (arms / "summary.json").read_text() == summary


def test_a_run_just_saved_reads_as_it_will_be_loaded(tmp_path):
    """What a runner hands its summary (``save_run``'s return) equals what a later session loads from disk."""
    converted = compact_records.compact_record(old_record(), REUSE_LM_KEYS)
    returned = save_run(tmp_path / "run.json", converted)
    assert returned == load_runs(tmp_path)["run"] and isinstance(returned["history"], list)
    assert [p.name for p in tmp_path.iterdir()] == ["run.json.gz"] and load_run(tmp_path / "run.json") == returned
    (tmp_path / "run.answers.json.gz").write_bytes(gzip.compress(b"[]"))  # a run's answers beside it: no record
    assert list(load_runs(tmp_path)) == ["run"]
    old = tmp_path / "old"
    write_old(old, old_record())
    assert load_runs(old)["dense-respo-R4-seed0"] == old_record()  # a record not yet converted reads as it was


def test_retired_records_keep_every_key_and_unknown_studies_are_refused(tmp_path):
    root = tmp_path / "benchmarks"
    write_old(root / "archive" / "v0.1" / "arms", old_record())
    compact_records.main([str(root), "--root", str(root)])
    stored = json.loads(read_record_text(root / "archive" / "v0.1" / "arms" / "dense-respo-R4-seed0.json"))
    assert DROPPED in stored["history"] and KEPT in stored["history"]  # nothing reads the archive: nothing dropped

    write_old(root / "new_study" / "arms", old_record())
    with pytest.raises(SystemExit, match="no kept history keys for study 'new_study'"):
        compact_records.main([str(root / "new_study"), "--root", str(root)])
    with pytest.raises(SystemExit, match="is not under --root"):
        compact_records.main([str(root / "new_study"), "--root", str(root / "archive")])
