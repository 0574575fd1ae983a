"""Honest figures: every `benchmarks/...` script and record README.md, BENCHMARKS.md and the user guide cite
exists; BENCHMARKS.md is a reference, not a diary: each of its sections names the command, the device, the date and
the record under benchmarks/results/ its table comes from; and its kernel ranges are what the records give
(benchmarks/figures.py computes them)."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = {"README.md": 0, "BENCHMARKS.md": 3, "docs/USER_GUIDE.md": 1}  # each doc -> how many paths it cites at least
# a path under benchmarks/ (or a record folder named from the results folder, `results/2026-...`), up to the first
# character a path here never holds; a `*` stands for any name, as in `2026-11-23-h200x2*/`
CITED = re.compile(r"(?<![\w/.-])(benchmarks/[\w./*-]+|results/20\d\d-[\w./*-]+)")
FIELDS = ("- Command: `", "- Device: ", "- Date: 20", "- Record: `benchmarks/results/20")
RECORD = re.compile(r"benchmarks/results/(20\d\d-[\w.-]+)/")


def _figures():
    spec = importlib.util.spec_from_file_location("figures", ROOT / "benchmarks" / "figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cited(text: str) -> set[str]:
    """Every benchmarks/ path the text names; a path wrapped after one of its slashes is joined again."""
    text = re.sub(r"/\n\s*", "/", text)
    paths = {m.rstrip(".:") for m in CITED.findall(text)}
    return {p if p.startswith("benchmarks/") else f"benchmarks/{p}" for p in paths}


@pytest.mark.parametrize("doc", DOCS)
def test_every_cited_script_and_record_exists(doc):
    paths = cited((ROOT / doc).read_text())
    assert len(paths) >= DOCS[doc]
    missing = sorted(p for p in paths if not (list(ROOT.glob(p)) if "*" in p else (ROOT / p).exists()))
    assert not missing, f"{doc} cites what the tree does not hold: {missing}"


def test_the_kernel_ranges_are_the_records():
    figures = _figures()
    assert len(figures.kernel_records()) >= 2 and "at the smallest share" in figures.kernel_phrase()
    benchmarks = " ".join((ROOT / "BENCHMARKS.md").read_text().split())
    for phrase in figures.phrases():
        assert phrase in benchmarks, f"BENCHMARKS.md should say, from the records: {phrase}"


def sections() -> list[str]:
    return re.split(r"(?m)^(?=## )", (ROOT / "BENCHMARKS.md").read_text())[1:]


@pytest.mark.parametrize("section", sections(), ids=lambda s: s.splitlines()[0][3:])
def test_every_table_names_its_command_device_date_and_record(section):
    head = section.split("\n|", 1)[0]
    assert "\n|---" in section, "a section of BENCHMARKS.md answers its question with a table"
    missing = [field for field in FIELDS if f"\n{field}" not in head]
    assert not missing, f"before its table, name {missing}: the run, where it ran, when, and its record folder"
    records = RECORD.findall(head)
    assert all((ROOT / "benchmarks" / "results" / r).is_dir() for r in records), records


def test_benchmarks_is_a_reference_not_a_diary():
    """Sessions, next calls and what was not run belong to the records' READMEs."""
    text = (ROOT / "BENCHMARKS.md").read_text()
    assert len(sections()) > 10
    diary = re.findall(r"(?i)\bsessions?\b|\bnot (?:yet )?(?:run|measured) this\b|\bnext calls?\b|\bissue \d+", text)
    assert not diary, diary
