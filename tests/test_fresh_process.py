"""memsave.fresh_process: a run forked from the warm process sees what a new
interpreter would (its environment, PYTHONPATH, argv, working folder, an allocator
of its own), and fails, times out and is killed as one would."""

import json
import os
import signal

import pytest

from memsave import fresh_process
from memsave.errors import MemsaveError

pytestmark = pytest.mark.measures  # (deadlines and timeouts: a loaded machine misses them)

SHOW = """
import json, os, sys
print(json.dumps({"parent": os.getppid(), "argv": sys.argv, "cwd": os.getcwd(),
                  "path": sys.path[:3], "flag": os.environ.get("MEMSAVE_PROBE"),
                  "tf_loaded": "tensorflow" in sys.modules}))
"""

PEAK = """
import os, sys
import tensorflow as tf
x = tf.random.normal([int(sys.argv[1])])
y = tf.reduce_sum(tf.tanh(x) * 2.0)
print(os.getppid(), tf.config.experimental.get_memory_info("CPU:0")["peak"])
"""


def _shown(done):
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def _env(**extra):
    return dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true", **extra)


def test_a_forked_run_sees_its_environment_path_argv_and_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shown = _shown(fresh_process.run_python(SHOW, ["a", 2], timeout=60, env=_env(
        PYTHONPATH=os.pathsep.join(["extra", ""]), MEMSAVE_PROBE="yes")))
    assert shown["parent"] != os.getpid()  # forked from the warm process
    assert shown["tf_loaded"]  # ... which had imported TensorFlow
    assert shown["argv"] == ["-c", "a", "2"]
    assert shown["cwd"] == str(tmp_path)
    assert shown["path"][:2] == ["", str(tmp_path / "extra")]
    assert shown["flag"] == "yes"
    # The next run does not inherit the last one's variables.
    assert _shown(fresh_process.run_python(SHOW, timeout=60, env=_env()))["flag"] is None


def test_a_variable_read_on_import_gets_a_warm_process_of_its_own():
    first = _shown(fresh_process.run_python(SHOW, timeout=60, env=_env()))
    again = _shown(fresh_process.run_python(SHOW, timeout=60, env=_env()))
    other = _shown(fresh_process.run_python(SHOW, timeout=60, env=_env(TF_MEMSAVE_PROBE="1")))
    assert first["parent"] == again["parent"]
    assert other["parent"] not in (first["parent"], os.getpid())


def test_each_forked_run_starts_with_an_allocator_of_its_own(monkeypatch):
    sizes = [4 << 20, 1 << 20]  # floats: 16 MiB, then 4 MiB

    def peaks(runs_of):
        runs = [fresh_process.run_python(PEAK, [n], env=_env(), timeout=120).stdout.split()
                for n in runs_of]
        return [int(parent) for parent, _ in runs], [int(peak) for _, peak in runs]

    forked_parents, forked = peaks(sizes)
    # A new interpreter (4 s here) for the smaller run only: what a fresh allocator holds.
    monkeypatch.setenv(fresh_process.MODE_ENV, "spawn")
    spawned_parents, spawned = peaks(sizes[1:])
    assert os.getpid() not in forked_parents and spawned_parents == [os.getpid()]
    # The second, smaller run does not report the first one's peak.
    assert forked[1:] == spawned and forked[1] < forked[0], (forked, spawned)


def test_a_forked_run_has_a_main_module_of_its_own_and_runs_its_exit_handlers():
    code = """
import atexit, pickle
class Point:
    pass
pickle.loads(pickle.dumps(Point()))  # finds Point in __main__
atexit.register(print, "exit handler ran")
"""
    done = fresh_process.run_python(code, env=_env(), timeout=None)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "exit handler ran"


def test_failures_time_outs_and_signals_come_back_as_from_a_new_interpreter():
    failed = fresh_process.run_python("raise KeyError('boom')", env=_env(), timeout=60)
    assert failed.returncode == 1 and "KeyError: 'boom'" in failed.stderr
    exited = fresh_process.run_python("import sys; sys.exit(3)", env=_env(), timeout=60)
    assert exited.returncode == 3
    killed = fresh_process.run_python("import os; os.kill(os.getpid(), 9)", env=_env(),
                                      timeout=60)
    assert killed.returncode == -signal.SIGKILL
    slow = fresh_process.run_python("import time; print('started', flush=True); time.sleep(60)",
                                    env=_env(), timeout=2)
    assert slow.timed_out and slow.returncode is None and slow.stdout.startswith("started")


def test_spawn_mode_starts_a_new_interpreter(monkeypatch):
    monkeypatch.setenv(fresh_process.MODE_ENV, "spawn")
    assert _shown(fresh_process.run_python(SHOW, timeout=60))["parent"] == os.getpid()


def test_an_unknown_mode_is_refused_with_the_accepted_ones(monkeypatch):
    monkeypatch.setenv(fresh_process.MODE_ENV, "thread")
    with pytest.raises(MemsaveError, match="MEMSAVE_FRESH_PROCESS='thread'; expected 'fork'"):
        fresh_process.run_python("pass")


def test_where_the_warm_process_cannot_start_runs_start_new_interpreters(monkeypatch):
    monkeypatch.setattr(fresh_process, "_ZYGOTE", "import sys; sys.exit(0)")
    monkeypatch.setattr(fresh_process, "_unstartable", set())
    started = []
    real = fresh_process._Zygote

    def counted(*args):
        started.append(args)
        return real(*args)

    monkeypatch.setattr(fresh_process, "_Zygote", counted)
    env = _env(TF_MEMSAVE_PROBE="cannot start")
    for _ in range(2):
        assert _shown(fresh_process.run_python(SHOW, env=env, timeout=60))["parent"] == os.getpid()
    assert len(started) == 1  # tried once, then no more


def test_a_run_whose_warm_process_ends_under_it_is_killed_not_run_again(tmp_path):
    marker = tmp_path / "ran"
    code = f"""
import os, time
with open({str(marker)!r}, "a") as out:
    out.write("ran\\n")
if os.getppid() != {os.getpid()}:  # (never the test's own process)
    os.kill(os.getppid(), 9)
time.sleep(30)
"""
    env = _env(TF_MEMSAVE_PROBE="ends")
    done = fresh_process.run_python(code, env=env, timeout=60)
    assert done.returncode == -signal.SIGKILL and fresh_process._LOST in done.stderr
    assert marker.read_text() == "ran\n"
    # The next run gets a new warm process.
    assert _shown(fresh_process.run_python(SHOW, env=env, timeout=60))["parent"] != os.getpid()
