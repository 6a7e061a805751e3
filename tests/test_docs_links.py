"""The docs' relative links and images resolve: README.md, every docs/**/*.md, DEVELOPERS.md, CHANGELOG.md and the
model cards.

A dead link is a file moved or renamed without its readers (docs/benchmarks.md became one page per study in 0.5 and
every relative path inside the moved text changed; one image link was already dead then). Checked: markdown links and
images ``[text](target)`` / ``![alt](target)``, reference definitions ``[id]: target`` and HTML ``src=`` / ``href=``,
outside fenced code blocks and inline code; ``http(s):``, ``mailto:`` and other schemes are not followed. An anchor
(``file.md#heading`` or ``#heading``) must be a heading of the target file, slugged as GitHub does (lower case,
punctuation other than ``-`` and ``_`` dropped, spaces to ``-``, repeats numbered ``-1``, ``-2``), or an HTML
``id``/``name`` in it. Also: every test file is listed in docs/testing.md, and the docs run benchmarks as modules.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parents[1]

FENCE = re.compile(r"^\s{0,3}(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
# [text](target) and ![alt](target); the text may hold one level of brackets (an image inside a link)
LINK = re.compile(
    r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]"  # [text] or ![alt], one level of brackets inside
    r"\(\s*(<[^>]*>|[^()\s]*(?:\([^()\s]*\)[^()\s]*)*)"  # (target: <...>, or a path with balanced parentheses
    r"(?:\s+[\"'(][^)]*)?\s*\)"  # and an optional "title")
)
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)", re.M)
HTML = re.compile(r"""\b(?:src|href)\s*=\s*["']([^"']+)["']""")
HTML_ID = re.compile(r"""\b(?:id|name)\s*=\s*["']([^"']+)["']""")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def markdown_files() -> list[Path]:
    """README.md and docs/**/*.md, and the other pages a reader follows links from: the top-level *.md (DEVELOPERS.md,
    CHANGELOG.md) and model_cards/*.md."""
    top = [p for p in sorted(ROOT.glob("*.md")) if p.name != "README.md"]
    cards = sorted((ROOT / "model_cards").glob("*.md"))
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *top, *cards]


def prose_lines(text: str, blank_code: bool = True) -> list[tuple[int, str]]:
    """``(line number, line)`` outside fenced code blocks, with inline code spans blanked (or kept)."""
    out, fence = [], None
    for number, line in enumerate(text.splitlines(), 1):
        match = FENCE.match(line)
        if match:
            if fence is None:
                fence = match.group(1)
            elif match.group(1) == fence:
                fence = None
            continue
        if fence is None:
            out.append((number, INLINE_CODE.sub(lambda m: " " * len(m.group(0)), line) if blank_code else line))
    return out


def targets(text: str) -> list[tuple[int, str]]:
    """``(line number, target)`` of every link, image, reference definition and HTML src/href; a link whose text wraps
    onto the next line is found too (consecutive prose lines are searched together)."""
    found, block, first = [], [], 0
    lines = prose_lines(text)
    for index, (number, line) in enumerate(lines):
        if not block:
            first = number
        block.append(line)
        ends = index + 1 == len(lines) or lines[index + 1][0] != number + 1 or not line.strip()
        if not ends:
            continue
        joined = "\n".join(block)
        for pattern in (LINK, REFERENCE, HTML):
            for match in pattern.finditer(joined):
                line = first + joined.count("\n", 0, match.start(1))
                found.append((line, match.start(1), match.group(1).strip("<>")))
        block = []
    return [(number, target) for number, _, target in sorted(found)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: inline markup removed, lower case, everything but letters, digits,
    spaces, ``-`` and ``_`` dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links and images: their text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "")
    text = re.sub(r"(\*+|(?<!\w)_+|_+(?!\w))", "", text)  # emphasis markers, not snake_case
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = path.read_text(encoding="utf-8")
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose_lines(text, blank_code=False):
        heading = re.match(r"^\s{0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            base = slug(heading.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            out.add(base if count == 0 else f"{base}-{count}")
    out.update(HTML_ID.findall(text))
    return out


def dead_links(path: Path) -> list[str]:
    """Every relative link or image of ``path`` that does not resolve, as ``file:line: target (why)``."""
    dead = []
    for number, target in targets(path.read_text(encoding="utf-8")):
        if not target or SCHEME.match(target):
            continue
        where = f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{number}: {target}"
        file_part, _, fragment = target.partition("#")
        file_part = unquote(file_part.split("?", 1)[0])
        resolved = (path.parent / file_part).resolve() if file_part else path
        if file_part and not resolved.exists():
            dead.append(f"{where} (no such file)")
        elif fragment and resolved.suffix == ".md" and unquote(fragment).lower() not in anchors(resolved):
            dead.append(f"{where} (no such heading)")
    return dead


def test_every_relative_link_and_image_in_the_docs_resolves():
    dead = [line for path in markdown_files() for line in dead_links(path)]
    assert not dead, "\n".join(dead)


def test_the_checker_finds_what_is_dead_and_skips_what_is_not(tmp_path):
    """The checker itself: dead files, images and anchors are reported; code, external links and live anchors are
    not."""
    (tmp_path / "other.md").write_text("# Other page\n\n## 5.5 Why VESPO leads: `cycle_kl`\n\n## Twice\n\n## Twice\n")
    (tmp_path / "pic.png").write_bytes(b"")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n"
        "[ok](other.md) ![ok](pic.png) [ok](other.md#55-why-vespo-leads-cycle_kl) [ok](other.md#twice-1) [ok](#page)\n"
        "[ok](https://example.com/missing.md) [ok](mailto:someone@example.com) `[not a link](missing.md)`\n"
        "```\n[in a code block](missing.md)\n```\n"
        "[dead](missing.md) ![dead](gone.png) [dead](other.md#no-such-heading) [dead](#nowhere) [a link whose text\n"
        "wraps](wrapped-missing.md)\n"
        '[ref]: also-missing.md\n<img src="missing.png">\n'
    )
    dead = [line.split(": ", 1)[1] for line in dead_links(page)]
    assert dead == [
        "missing.md (no such file)",
        "gone.png (no such file)",
        "other.md#no-such-heading (no such heading)",
        "#nowhere (no such heading)",
        "wrapped-missing.md (no such file)",
        "also-missing.md (no such file)",
        "missing.png (no such file)",
    ]


def test_docs_testing_lists_every_test_file():
    """docs/testing.md's table names every test module of the main suite (a new file without its line is caught)."""
    listed = (ROOT / "docs" / "testing.md").read_text(encoding="utf-8")
    missing = [p.name for p in sorted((ROOT / "tests").glob("test_*.py")) if f"`{p.name}`" not in listed]
    assert not missing, f"docs/testing.md does not list: {missing}"


def test_docs_run_benchmarks_as_modules():
    """A benchmark is run as ``python -m benchmarks.NAME`` (the package's imports need the repository root on the
    path, which ``-m`` gives from the root); ``python benchmarks/NAME.py`` in a doc is the old form."""
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]  # not CHANGELOG.md: history keeps its commands
    old = [f"{path.relative_to(ROOT)}:{n}" for path in docs
           for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
           if re.search(r"python3? +benchmarks/\w+\.py", line)]  # fmt: skip
    assert not old, old


# A data file a page names: a path ending in a data suffix, anywhere in the page (prose, inline code, code blocks).
DATA_FILE = re.compile(r"(?<![\w./$<*-])((?:\.\./)*[\w.-]+(?:/[\w.-]+)*\.(?:json\.gz|jsonl|json|png|csv))(?![\w*])")
OUTPUT_FLAG = re.compile(r"--(?:out|output|report-out)[= ]+\S*$")


def missing_data_files(path: Path) -> list[str]:
    """Every data file ``path`` names under ``docs/benchmarks/`` (a path that says so, or a path relative to a page of
    that folder) that does not exist, as ``file:line: path``. Output arguments (``--out X``) name what a command
    will write and are skipped, as are globs and placeholders (``*``, ``<...>``)."""
    missing = []
    page_dir = path.parent
    in_benchmarks = page_dir == ROOT / "docs" / "benchmarks" or ROOT / "docs" / "benchmarks" in page_dir.parents
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        for match in DATA_FILE.finditer(line):
            name = match.group(1)
            if OUTPUT_FLAG.search(line[: match.start()]):
                continue
            if "docs/benchmarks/" in name:
                resolved = ROOT / name[name.index("docs/benchmarks/") :]
            elif "benchmarks/" in name and not in_benchmarks:
                resolved = (page_dir / name).resolve()
            elif in_benchmarks and "/" in name:
                resolved = (page_dir / name).resolve()
            else:
                continue  # a bare file name (an output of a command, a file of a run's folder): not a claim of ours
            if not resolved.exists():
                missing.append(f"{path.relative_to(ROOT)}:{number}: {name}")
    return missing


def test_every_data_file_a_page_names_exists():
    """Study data lives beside its page (docs/benchmarks/<study>/): a page that names a JSON or plot names one that is
    there. Catches data moved without its readers, and a page quoting a file nobody committed."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), ROOT / "DEVELOPERS.md"]
    missing = [line for page in pages for line in missing_data_files(page)]
    assert not missing, "\n".join(missing)


def test_the_data_checker_finds_a_missing_file_and_skips_outputs(tmp_path, monkeypatch):
    import test_docs_links as checker

    monkeypatch.setattr(checker, "ROOT", tmp_path)
    study = tmp_path / "docs" / "benchmarks" / "study"
    study.mkdir(parents=True)
    (study / "there.json").write_text("{}")
    page = tmp_path / "docs" / "benchmarks" / "study.md"
    page.write_text("![plot](study/gone.png) `study/there.json` and docs/benchmarks/study/missing.json\n"
                    "```bash\npython -m benchmarks.study --out docs/benchmarks/study/new.json  # writes study/*.json\n```\n")
    assert missing_data_files(page) == ["docs/benchmarks/study.md:1: study/gone.png",
                                        "docs/benchmarks/study.md:1: docs/benchmarks/study/missing.json"]


def test_each_study_page_has_its_data_folder_and_its_module():
    """docs/benchmarks/<study>.md keeps its JSON and plots in docs/benchmarks/<study>/, and its module is
    benchmarks/<study>.py unless docs/benchmarks.md's map names the module(s) that write it."""
    summary = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    folder = ROOT / "docs" / "benchmarks"
    loose = [p.name for p in folder.iterdir() if p.is_file() and p.suffix != ".md"]
    assert not loose, f"data outside a study folder: {loose}"
    for page in sorted(folder.glob("*.md")):
        if page.stem == "claims":  # the paper's claims against ours: a summary, no data of its own
            continue
        module = ROOT / "benchmarks" / f"{page.stem}.py"
        assert module.exists() or f"[{page.stem}.md]" in summary or f"({page.stem}.md)" in summary, page.name
        data = folder / page.stem
        assert data.is_dir() or "no data" in page.read_text(encoding="utf-8")[:1500], f"{page.name}: no {data.name}/"
