"""Packaging: installing memsave never pulls a second TensorFlow on top of an installed one.

TensorFlow ships as several distributions pip treats as unrelated (tensorflow,
tensorflow-cpu, tf-nightly, tensorflow[and-cuda], ...), so memsave names none of
them in install_requires; the extras `cpu`, `tensorflow` and `gpu` pick one, and
memsave checks the version when imported.

The install tests ask pip itself, in a fresh virtual environment that sees the
TensorFlow this test suite runs on: a `--dry-run --report` resolves exactly what
`pip install <repo>` would do, offline, without changing anything.
"""

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Distributions that each provide the `tensorflow` module (or replace Keras inside it).
TF_DISTRIBUTIONS = {
    "tensorflow", "tensorflow-cpu", "tensorflow-gpu", "tf-nightly", "tf-nightly-cpu",
    "tensorflow-intel", "tensorflow-macos", "tensorflow-aarch64", "tensorflow-cpu-aws",
    "intel-tensorflow", "keras", "tf-keras",
}

needs_source_tree = pytest.mark.skipif(
    not (REPO / "setup.cfg").is_file(), reason="needs the memsave source tree (setup.cfg)")


def normalize(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement):
    return normalize(re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement).group(1))


def isolated_pip_env():
    """The environment for a pip that ignores this machine's pip configuration."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1",
               PIP_NO_INPUT="1", PYTHONNOUSERSITE="1")
    return env


@pytest.fixture(scope="module")
def venv_with_this_tensorflow(tmp_path_factory):
    """A fresh venv whose only packages are those of the running environment (TensorFlow too).

    The running environment's site-packages are added with a .pth file, so pip
    in the new venv finds the installed TensorFlow exactly as a user's own
    environment would show it.
    """
    pytest.importorskip("setuptools", reason="the offline build of memsave's metadata needs it")
    root = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "venv")],
                   check=True, timeout=60)
    python = root / "venv" / ("Scripts" if os.name == "nt" else "bin") / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True, timeout=60).stdout.strip()
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    ours.update(p for p in sys.path if p.rstrip("/\\").endswith(("site-packages", "dist-packages")))
    Path(purelib, "running-env.pth").write_text("\n".join(sorted(ours)) + "\n")
    return python


def dry_run(python, requirement, tmp_path, offline=True):
    """`pip install --dry-run --report` of `requirement` in the venv of `python`.

    Returns:
      The parsed installation report (pip's JSON), and pip's output.
    """
    report = tmp_path / "report.json"
    command = [str(python), "-m", "pip", "install", "--dry-run", "--report", str(report)]
    if offline:
        command += ["--no-index", "--no-build-isolation"]
    command.append(requirement)
    done = subprocess.run(command, capture_output=True, text=True, timeout=300,
                          env=isolated_pip_env() if offline else None, cwd=tmp_path)
    assert done.returncode == 0, f"pip failed:\n{done.stdout}\n{done.stderr}"
    return json.loads(report.read_text()), done.stdout + done.stderr


def installed_names(report):
    return sorted(normalize(item["metadata"]["name"]) for item in report["install"])


def test_the_running_environment_has_one_tensorflow():
    providers = importlib.metadata.packages_distributions().get("tensorflow", [])
    tf_providers = {normalize(p) for p in providers} & TF_DISTRIBUTIONS
    assert len(tf_providers) == 1, f"expected exactly one TensorFlow distribution, got {providers}"


@pytest.fixture(scope="module")
def plain_install(venv_with_this_tensorflow, tmp_path_factory):
    """The dry-run report and output of `pip install <repo>` over the running TensorFlow."""
    return dry_run(venv_with_this_tensorflow, str(REPO), tmp_path_factory.mktemp("plain"))


@needs_source_tree
def test_install_over_existing_tensorflow_adds_only_memsave(plain_install):
    report, output = plain_install
    assert installed_names(report) == ["memsave"], output
    # pip saw the installed TensorFlow's numpy and left it alone.
    assert "Would install memsave-" in output


@needs_source_tree
def test_cpu_extra_reuses_an_installed_tensorflow_cpu(venv_with_this_tensorflow, tmp_path):
    installed = {normalize(d.metadata["Name"]) for d in importlib.metadata.distributions()}
    if "tensorflow-cpu" not in installed:
        pytest.skip("the running environment's TensorFlow is not tensorflow-cpu")
    report, output = dry_run(venv_with_this_tensorflow, f"{REPO}[cpu]", tmp_path)
    assert installed_names(report) == ["memsave"], output
    (item,) = report["install"]
    assert item["requested_extras"] == ["cpu"]
    assert re.search(r"Requirement already satisfied: tensorflow-cpu>=2\.16", output), output


@needs_source_tree
def test_metadata_names_tensorflow_only_in_extras(plain_install):
    report, _ = plain_install
    requires = report["install"][0]["metadata"]["requires_dist"]
    unconditional = [r for r in requires if "extra ==" not in r]
    assert {requirement_name(r) for r in unconditional} == {"numpy"}
    by_extra = {}
    for r in requires:
        extra = re.search(r'extra\s*==\s*"([^"]+)"', r)
        if extra:
            by_extra.setdefault(extra.group(1), []).append(r)
    # Each TensorFlow extra requests exactly one TensorFlow distribution, and it is >= 2.16.
    for extra, distribution in [("cpu", "tensorflow-cpu"), ("tensorflow", "tensorflow"),
                                ("gpu", "tensorflow")]:
        tf_reqs = [r for r in by_extra[extra] if requirement_name(r) in TF_DISTRIBUTIONS]
        assert len(tf_reqs) == 1 and requirement_name(tf_reqs[0]) == distribution, tf_reqs
        assert ">=2.16" in tf_reqs[0].replace(" ", "")
    assert re.match(r"tensorflow\s*\[\s*and-cuda\s*\]", by_extra["gpu"][0])
    # The test and bench extras never pull TensorFlow.
    for extra in ("test", "bench"):
        assert not [r for r in by_extra[extra] if requirement_name(r) in TF_DISTRIBUTIONS]
    assert {"pytest", "pytest-benchmark", "hypothesis"} <= {
        requirement_name(r) for r in by_extra["test"]}
    assert "matplotlib" in {requirement_name(r) for r in by_extra["bench"]}


@needs_source_tree
@pytest.mark.skipif(os.environ.get("MEMSAVE_NETWORK_TESTS") != "1",
                    reason="resolves TensorFlow from the package index (~40 s); "
                           "set MEMSAVE_NETWORK_TESTS=1 to run")
def test_cpu_extra_on_a_bare_machine_installs_tensorflow_cpu_once(tmp_path):
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "bare")],
                   check=True, timeout=60)
    bare_python = tmp_path / "bare" / "bin" / "python"
    report = tmp_path / "report.json"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(bare_python), "install",
                    "--dry-run", "--quiet", "--report", str(report), f"{REPO}[cpu]"],
                   check=True, timeout=300, cwd=tmp_path)
    names = installed_names(json.loads(report.read_text()))
    assert [n for n in names if n in TF_DISTRIBUTIONS - {"keras"}] == ["tensorflow-cpu"]
    assert "memsave" in names and "numpy" in names


# --- the version check at import time ---------------------------------------------------


def run_python(code, extra_path=None):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    if extra_path:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(extra_path), env.get("PYTHONPATH"))
                                            if p)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=120, env=env, cwd=REPO.parent)


def test_import_without_tensorflow_says_how_to_install():
    done = run_python("""
        import sys
        sys.modules["tensorflow"] = None  # makes `import tensorflow` fail
        import memsave
        """)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: memsave: TensorFlow is not installed"), done.stderr
    assert "pip install memsave[cpu]" in last and "tensorflow-cpu" in last


def test_import_with_old_tensorflow_names_the_version(tmp_path):
    fake = tmp_path / "tensorflow"
    fake.mkdir()
    (fake / "__init__.py").write_text('__version__ = "2.15.1"\n')
    done = run_python("import memsave", extra_path=tmp_path)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: memsave: needs TensorFlow >= 2.16, found 2.15.1"), done.stderr
    assert "memsave[cpu]" in last


@pytest.mark.parametrize("version, ok", [
    ("2.21.0", True), ("2.16.0rc1", True), ("2.16.0-rc0", True), ("2.17.0.dev20240501", True),
    ("3.0.0", True), ("2.15.1", False), ("2.9.3", False), ("1.15.5", False),
])
def test_version_check_in_process(monkeypatch, version, ok):
    from memsave import _version_check

    fake = type(sys)("tensorflow")
    fake.__version__ = version
    monkeypatch.setitem(sys.modules, "tensorflow", fake)
    if ok:
        _version_check.check_tensorflow_version()
    else:
        with pytest.raises(ImportError, match=rf"memsave: needs TensorFlow >= 2\.16, found {version}"):
            _version_check.check_tensorflow_version()


def test_version_check_missing_tensorflow_in_process(monkeypatch):
    from memsave import _version_check

    monkeypatch.setitem(sys.modules, "tensorflow", None)
    with pytest.raises(ImportError, match="memsave: TensorFlow is not installed") as info:
        _version_check.check_tensorflow_version()
    assert isinstance(info.value.__cause__, ImportError)


# --- the README's commands and .ci/run --------------------------------------------------


@pytest.mark.skipif(not (REPO / "README.md").is_file() or not (REPO / ".ci" / "run").is_file(),
                    reason="needs the source tree's README.md and .ci/run")
def test_ci_runs_the_readme_test_command_verbatim():
    readme = (REPO / "README.md").read_text()
    first_block = re.search(r"```(?:bash|sh)?\n(.*?)```", readme, re.S).group(1)
    commands = [line.strip() for line in first_block.splitlines() if line.strip()]
    assert commands == ['pip install ".[cpu,bench]" && python benchmarks/compare.py',
                        'pip install ".[cpu,test]" && pytest -q -n 2 --dist loadfile tests']
    ci = (REPO / ".ci" / "run").read_text()
    assert commands[1] in [line.strip() for line in ci.splitlines()]
    assert "set -euo pipefail" in ci
    assert os.access(REPO / ".ci" / "run", os.X_OK)
    assert (REPO / "benchmarks" / "compare.py").is_file()
