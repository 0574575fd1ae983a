"""Honest figures (issue 34): every `benchmarks/...` script and record README.md, BENCHMARKS.md and the user guide
cite exists; README's kernel ranges are what the records give (benchmarks/figures.py computes them); and every
BENCHMARKS.md section with figures from a GPU names its record under benchmarks/results/ or says it has none."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "BENCHMARKS.md", "docs/USER_GUIDE.md")
# a path under benchmarks/ (or a record folder named from the results folder, `results/2026-...`), up to the first
# character a path here never holds; a `*` stands for any name, as in `2026-11-23-h200x2*/`
CITED = re.compile(r"(?<![\w/.-])(benchmarks/[\w./*-]+|results/20\d\d-[\w./*-]+)")
GPU = re.compile(r"\b(H100|H200|nvidia-h[12]00)")
FIGURE = re.compile(r"\d ?(ms|GiB|TFLOP/s)\b|\d\.\d+e-\d")
RECORD = re.compile(r"(benchmarks/)?results/20\d\d-|no record", re.I)


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
    assert len(paths) >= (3 if doc == "BENCHMARKS.md" else 1)
    missing = sorted(p for p in paths if not (list(ROOT.glob(p)) if "*" in p else (ROOT / p).exists()))
    assert not missing, f"{doc} cites what the tree does not hold: {missing}"


def test_the_readme_kernel_ranges_are_the_records():
    figures = _figures()
    assert len(figures.kernel_records()) >= 2 and "at the smallest share" in figures.kernel_phrase()
    readme = " ".join((ROOT / "README.md").read_text().split())
    for phrase in figures.readme_phrases():
        assert phrase in readme, f"README.md should say, from the records: {phrase}"


def test_every_section_with_gpu_figures_names_its_record():
    sections = re.split(r"(?m)^(?=## )", (ROOT / "BENCHMARKS.md").read_text())[1:]
    unrecorded = [s.splitlines()[0] for s in sections if GPU.search(s) and FIGURE.search(s) and not RECORD.search(s)]
    assert len(sections) > 10 and not unrecorded, (
        f"BENCHMARKS.md sections with GPU figures and no record: {unrecorded}; name the folder under "
        f"benchmarks/results/ that holds the run's output, or say 'no record' and what re-runs it")
