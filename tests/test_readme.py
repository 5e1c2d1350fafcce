"""Every Python example of the README and of docs/ runs as written, and saves memory;
the README stays a guide and every link in them leads somewhere.

Each ```python block is executed in a fresh namespace, in order, with memsave's
default choices (no always_rewrite): the rewrite must be used (the latest report has
no fallback), so an example sized too small to save anything fails here.
"""

import glob
import os
import re
import runpy
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
RESULTS = os.path.join(ROOT, "benchmarks", "RESULTS.md")
DOCS = sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
PAGES = [README] + DOCS
# The README is a guide, RESULTS.md today's figures per machine: their history goes to
# benchmarks/JOURNAL.md.
README_MAX_LINES, RESULTS_MAX_LINES = 300, 400


def _python_blocks(path):
    text = open(path).read()
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


# An example that sets TensorFlow's environment before importing it runs as a script of
# its own (this process imported TensorFlow long ago).
_SETS_ENVIRONMENT = "os.environ.setdefault(\"TF_"


def _run_in_its_own_process(script):
    """Runs `script` in a fresh Python; it must build a rewrite (a strategy's summary
    printed) and, where it calibrates, plan with the calibration."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    summaries = [line for line in done.stdout.splitlines() if line.startswith("memsave: ")]
    assert summaries and summaries[-1].startswith("memsave: strategy"), done.stdout
    if "calibrate_memory" in script.read_text():
        assert "calibrated:" in summaries[-1], done.stdout


def _page_name(path):
    return os.path.splitext(os.path.basename(path))[0]


BLOCKS = [(path, index, block) for path in PAGES
          for index, block in enumerate(_python_blocks(path))]


def test_the_readme_and_every_page_of_docs_have_examples():
    assert len(_python_blocks(README)) >= 5
    assert len(DOCS) >= 6
    assert len(BLOCKS) >= 12


@pytest.mark.planner_fallback
@pytest.mark.parametrize("page, index, block", BLOCKS,
                         ids=[f"{_page_name(p)}-block{i}" for p, i, _ in BLOCKS])
def test_example_runs_and_saves(page, index, block, capsys, tmp_path):
    import memsave
    from memsave import report

    # (A report of an earlier test does not count.)
    report._latest.report = report._latest_of_any_thread[0] = None
    # Run from a file, as a user's script: AutoGraph reads the functions' source.
    script = tmp_path / f"{_page_name(page)}_block{index}.py"
    script.write_text(block)
    if _SETS_ENVIRONMENT in block:
        _run_in_its_own_process(script)
        return
    runpy.run_path(str(script), run_name="__main__")
    latest = memsave.last_report()
    assert latest is not None, "the example made no memsave call"
    assert latest.fallback is None, latest.fallback
    assert latest.predicted_peak_bytes < latest.baseline_peak_bytes
    printed = capsys.readouterr().out
    assert "memsave: strategy" in printed, printed


def test_the_readme_is_a_guide_and_results_are_todays():
    readme = open(README).read().splitlines()
    assert len(readme) <= README_MAX_LINES, f"README.md has {len(readme)} lines"
    results = open(RESULTS).read().splitlines()
    assert len(results) <= RESULTS_MAX_LINES, f"RESULTS.md has {len(results)} lines"


def _anchors(path):
    """The anchors GitHub gives a Markdown file's headings."""
    anchors = set()
    for line in open(path).read().splitlines():
        heading = re.match(r"^#{1,6} (.*)", line)
        if heading:
            text = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower())
            anchors.add(text.replace(" ", "-"))
    return anchors


def _relative_links(path):
    text = re.sub(r"^```.*?^```", "", open(path).read(), flags=re.S | re.M)
    return [target for target in re.findall(r"\]\(([^)\s]+)\)", text)
            if not re.match(r"[a-z]+:", target)]


@pytest.mark.parametrize("page", PAGES + [RESULTS], ids=_page_name)
def test_every_relative_link_leads_to_a_file_and_heading(page):
    broken = []
    for target in _relative_links(page):
        file_part, _, anchor = target.partition("#")
        linked = os.path.normpath(os.path.join(os.path.dirname(page), file_part)) if file_part else page
        if not os.path.exists(linked):
            broken.append(target)
        elif anchor and linked.endswith(".md") and anchor not in _anchors(linked):
            broken.append(target)
    assert not broken, f"{os.path.relpath(page, ROOT)} links nowhere: {broken}"
