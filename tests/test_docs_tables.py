"""The generated tables of README.md and BENCHMARKS.md (tools/tables.py) against the raw results under
bench/results/: a row older than the newest result of its benchmark, or one that differs from it, fails here. The
other tests show that the check can fail: a doctored copy of README.md, a newer result, a result made by another
command. Reads files only; imports nothing of hetmoe."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "tables.py"


def _load():
    spec = importlib.util.spec_from_file_location("docs_tables", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tables = _load()


def _docs_copy(tmp_path: Path) -> Path:
    """README.md and BENCHMARKS.md copied under tmp_path/docs."""
    docs = tmp_path / "docs"
    for name in {t["doc"] for t in tables.TABLES.values()}:
        (docs / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, docs / name)
    return docs


def _results_copy(tmp_path: Path) -> Path:
    """A tree whose bench/results/ links every real result file, for adding one."""
    results = tmp_path / "results"
    (results / "bench" / "results").mkdir(parents=True)
    for f in (ROOT / "bench" / "results").iterdir():
        (results / "bench" / "results" / f.name).symlink_to(f)
    return results


def _newest(source: str) -> Path:
    return tables.candidates(source)[-1][1]


def test_tables_match_the_newest_results():
    problems = tables.check()
    assert not problems, "\n".join(problems) + "\n(python3 tools/tables.py --write regenerates the tables)"


def test_every_row_comes_from_its_newest_result():
    """Each generated row links the newest result file of its source (the rule the check compares against)."""
    for name, table in tables.TABLES.items():
        lines, problems = tables.render(name)
        assert not problems, problems
        for (label, source, _), line in zip(table["rows"], [x for x in lines[2:] if x.startswith("|")]):
            newest = _newest(source).relative_to(ROOT).as_posix()
            assert line.startswith(f"| {label} |") and f"({newest})" in line, (name, label, newest, line)


def test_check_names_a_changed_number(tmp_path):
    docs = _docs_copy(tmp_path)
    readme = docs / "README.md"
    text = readme.read_text(encoding="utf-8")
    start, _ = tables._region(text, "readme-headline")
    lines = text.split("\n")
    row = next(i for i in range(start + 2, len(lines)) if lines[i].startswith("| decode"))
    label, number = tables._cells(lines[row])[:2]
    digit = re.search(r"\d", number)
    doctored = number[:digit.start()] + str((int(digit.group()) + 1) % 10) + number[digit.end():]
    lines[row] = lines[row].replace(f"| {number} |", f"| {doctored} |", 1)
    readme.write_text("\n".join(lines), encoding="utf-8")

    problems = tables.check(docs_root=docs)
    assert len(problems) == 1, problems
    assert f"row '{label}' differs" in problems[0] and doctored in problems[0]

    cli = subprocess.run([sys.executable, str(TOOL), "--check", "--docs", str(docs)], capture_output=True, text=True)
    assert cli.returncode == 1 and f"row '{label}'" in cli.stdout, cli.stdout + cli.stderr


def test_check_names_a_row_older_than_a_new_result(tmp_path):
    results = _results_copy(tmp_path)
    old = _newest("qwen3-decode")
    new = results / "bench" / "results" / ("2099-01-01" + old.name[10:].rsplit("-", 1)[0] + "-abcdef1" + old.suffix)
    new.write_text(old.read_text(encoding="utf-8"), encoding="utf-8")

    problems = tables.check(results_root=results)
    rows = [p for p in problems if "the newest result is" in p]
    assert rows and all(new.name in p for p in rows), problems
    assert any("README.md: table readme-headline, row 'decode, batch 1, CUDA graph' names" in p for p in rows)


def test_check_names_a_result_made_by_another_command(tmp_path):
    results = _results_copy(tmp_path)
    old = _newest("qwen3-decode")
    text = old.read_text(encoding="utf-8")
    repeats = re.search(r"median of (\d+) repeats", text)
    other = int(repeats.group(1)) + 1
    new = results / "bench" / "results" / ("2099-01-01" + old.name[10:].rsplit("-", 1)[0] + "-abcdef1" + old.suffix)
    new.write_text(text.replace(repeats.group(0), f"median of {other} repeats"), encoding="utf-8")

    problems = tables.check(results_root=results)
    assert any("was not made by its command" in p and f"the file recorded {other}" in p for p in problems), problems


def test_a_missing_field_is_an_error_not_an_older_number(tmp_path):
    results = _results_copy(tmp_path)
    old = _newest("qwen3-gpu-prefill")
    text = old.read_text(encoding="utf-8")
    assert "gpu without the share" in text
    new = results / "bench" / "results" / ("2099-01-01" + old.name[10:].rsplit("-", 1)[0] + "-abcdef1" + old.suffix)
    new.write_text(re.sub(r"; gpu without the share\s+[\d.]+ tok/s", "", text), encoding="utf-8")

    lines, problems = tables.render("benchmarks-gpu-prefill", results)
    assert problems and all("has no field" in p and new.name in p for p in problems), problems
    assert not [x for x in lines[2:] if x.startswith("|")]
