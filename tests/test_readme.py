"""Every Python example of the README runs as written, and saves memory.

Each ```python block is executed in a fresh namespace, in order, with memsave's
default choices (no always_rewrite): the rewrite must be used (the latest report has
no fallback), so an example sized too small to save anything fails here.
"""

import os
import re
import runpy
import subprocess
import sys

import pytest

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def _python_blocks():
    text = open(README).read()
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


def _title(index, code):
    return f"block{index}"


BLOCKS = _python_blocks()


def test_the_readme_has_examples():
    assert len(BLOCKS) >= 5


@pytest.mark.planner_fallback
@pytest.mark.parametrize("index", range(len(BLOCKS)), ids=[_title(i, b) for i, b in enumerate(BLOCKS)])
def test_readme_example_runs_and_saves(index, capsys, tmp_path):
    import memsave
    from memsave import report

    # (A report of an earlier test does not count.)
    report._latest.report = report._latest_of_any_thread[0] = None
    # Run from a file, as a user's script: AutoGraph reads the functions' source.
    script = tmp_path / f"readme_block{index}.py"
    script.write_text(BLOCKS[index])
    if _SETS_ENVIRONMENT in BLOCKS[index]:
        _run_in_its_own_process(script)
        return
    runpy.run_path(str(script), run_name="__main__")
    latest = memsave.last_report()
    assert latest is not None, "the example made no memsave call"
    assert latest.fallback is None, latest.fallback
    assert latest.predicted_peak_bytes < latest.baseline_peak_bytes
    printed = capsys.readouterr().out
    assert "memsave: strategy" in printed, printed
