"""The docs as a front door that holds: every results table in docs/ is what its data file says
(scripts/results_tables.py), every relative link in the README and docs/ reaches a file and a heading there, and each
package's docstring names every one of its files."""

import ast
import fnmatch
import importlib.util
import json
import re
import shutil
from pathlib import Path

import pytest

from conftest import ROOT

_spec = importlib.util.spec_from_file_location("results_tables", ROOT / "scripts" / "results_tables.py")
results_tables = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(results_tables)

DOCS = ROOT / "docs"


def test_every_table_in_docs_is_its_data():
    # Fails naming the table; `python scripts/results_tables.py` rewrites it from the data (or fix the data).
    assert results_tables.check_or_write(DOCS, write=False) == []
    assert results_tables.main(["--check"]) == 0


@pytest.fixture
def docs_copy(tmp_path: Path) -> Path:
    shutil.copytree(DOCS, tmp_path / "docs", ignore=shutil.ignore_patterns("*.png"))
    return tmp_path / "docs"


def test_the_check_names_a_table_whose_data_changed_and_the_command_rewrites_it(docs_copy):
    data = docs_copy / "results" / "data" / "memory.json"
    tables = json.loads(data.read_text())
    assert tables["memory_0_5b"]["rows"][0][:2] == ["dense AdamW (all parameters)", "10.32"]
    tables["memory_0_5b"]["rows"][0][1] = "10.33"
    data.write_text(json.dumps(tables))

    assert results_tables.check_or_write(docs_copy, write=False) == [
        "results/memory.md: table 'memory_0_5b' differs from its data"]
    assert results_tables.main(["--check"], docs=docs_copy) == 1
    assert "| dense AdamW (all parameters) | 10.32 |" in (docs_copy / "results" / "memory.md").read_text()

    assert results_tables.main([], docs=docs_copy) == 0
    assert "| dense AdamW (all parameters) | 10.33 |" in (docs_copy / "results" / "memory.md").read_text()
    assert results_tables.check_or_write(docs_copy, write=False) == []


def test_the_check_names_a_table_edited_by_hand_and_one_without_data(docs_copy):
    page = docs_copy / "results" / "memory.md"
    page.write_text(page.read_text().replace("| 3.90 | 3.19 | 16.1 |", "| 3.90 | 3.20 | 16.1 |")
                    + "\n<!-- table: no_such_table -->\n<!-- /table -->\n")
    assert results_tables.check_or_write(docs_copy, write=False) == [
        "results/memory.md: table 'memory_profiler' differs from its data",
        "results/memory.md: table 'no_such_table' has no data"]
    assert results_tables.main([], docs=docs_copy) == 1  # the edited table rewritten, the one without data still fails
    assert results_tables.check_or_write(docs_copy, write=False) == [
        "results/memory.md: table 'no_such_table' has no data"]


# Links: [text](target) outside code, and the anchors GitHub gives headings.
FENCE = re.compile(r"^```.*?^```", re.M | re.S)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _prose(path: Path) -> str:
    return re.sub(r"`[^`\n]*`", "", FENCE.sub("", path.read_text()))


def github_anchor(heading: str) -> str:
    """GitHub's anchor for a heading: the text as rendered (a link's text), lower case, punctuation dropped
    (letters of any script, digits, `_` and `-` stay), spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found, seen = set(), {}
    for heading in re.findall(r"^#{1,6} (.+)$", FENCE.sub("", path.read_text()), re.M):
        anchor = github_anchor(heading)
        found.add(anchor if anchor not in seen else f"{anchor}-{seen[anchor]}")
        seen[anchor] = seen.get(anchor, 0) + 1
    return found


def test_github_anchors():
    assert github_anchor("What δ should I set?") == "what-δ-should-i-set"
    assert github_anchor("`configs/smollm2_reasoning.yaml` as shipped") == "configssmollm2_reasoningyaml-as-shipped"
    assert github_anchor("The reward–KL frontier") == "the-rewardkl-frontier"
    assert github_anchor("At the 0.5B shape") == "at-the-05b-shape"


def test_every_relative_link_in_the_readme_and_docs_resolves():
    pages = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
    broken, checked = [], 0
    for page in pages:
        for target in LINK.findall(_prose(page)):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            resolved = (page.parent / file).resolve() if file else page
            checked += 1
            if not resolved.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert checked > 100  # the links were found
    assert broken == []


PACKAGES = ["lightning_logra", "lightning_logra/algo", "lightning_logra/base", "lightning_logra/data",
            "lightning_logra/episodes", "lightning_logra/rewards", "lightning_logra/rollout",
            "lightning_logra/rollout/remote", "lightning_logra/rollout/server", "lightning_logra/sketch",
            "lightning_logra/train", "lightning_logra/train/strategies", "callbacks"]


@pytest.mark.parametrize("package", PACKAGES)
def test_each_package_docstring_says_what_each_of_its_files_holds(package):
    folder = ROOT / package
    docstring = ast.get_docstring(ast.parse((folder / "__init__.py").read_text()))
    named = re.findall(r"[\w*]+\.py|\w+/", docstring)  # file.py, vllm*.py, folder/
    files = [p.name for p in folder.glob("*.py") if p.name != "__init__.py"]
    folders = [f"{p.name}/" for p in folder.iterdir() if p.is_dir() and (p / "__init__.py").exists()]
    assert [name for name in files + folders if not any(fnmatch.fnmatch(name, n) for n in named)] == []
