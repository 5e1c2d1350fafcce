"""Measurements made once per test run, however many pytest-xdist workers ask for them.

A measured configuration runs in a process of its own (memsave.measure.run_isolated)
and takes seconds; tests that share one (a baseline, a case asserted two ways) would
measure it again on each worker they land on. `once_per_run` keeps the first result in
a folder of the run that every worker reads, under a lock, so a second worker waits for
the first instead of measuring beside it. Without xdist it just computes (callers keep
their own in-process cache).
"""

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile

RUN_ID_ENV = "PYTEST_XDIST_TESTRUNUID"  # set by pytest-xdist in each worker of one run


def run_directory(run_id):
    """The folder the workers of run `run_id` share."""
    return os.path.join(tempfile.gettempdir(), f"memsave-tests-{run_id}")


def once_per_run(key, compute):
    """`compute()`'s JSON-able result, computed by the first worker that asks for `key`.

    Args:
      key: a string naming the measurement (its configuration).
      compute: a callable returning a JSON-able value; a failure is not kept (the next
        worker to ask computes again and fails for itself).
    Returns:
      The value, as JSON gives it back where another worker computed it.
    """
    run_id = os.environ.get(RUN_ID_ENV)
    if not run_id:
        return compute()
    directory = run_directory(run_id)
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, hashlib.sha256(key.encode()).hexdigest()[:24])
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # (released when the file closes)
        with contextlib.suppress(FileNotFoundError), open(path + ".json") as kept:
            return json.load(kept)
        value = compute()
        with open(path + ".tmp", "w") as written:
            json.dump(value, written)
        os.replace(path + ".tmp", path + ".json")
        return value


def remove_run_directory(run_id):
    """Removes what the workers of run `run_id` kept (at the end of the run)."""
    shutil.rmtree(run_directory(run_id), ignore_errors=True)
