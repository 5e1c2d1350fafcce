"""Measurements made once per test run, however many pytest-xdist workers ask for them,
and made alone.

A measured configuration runs in a process of its own (memsave.measure.run_isolated)
and takes seconds; tests that share one (a baseline, a case asserted two ways) would
measure it again on each worker they land on. `once_per_run` keeps the first result in
a folder of the run that every worker reads, under a lock, so a second worker waits for
the first instead of measuring beside it. Without xdist it just computes (callers keep
their own in-process cache).

`alone_or_beside_others` keeps a test marked `measures` from running beside any other:
a peak or a time measured while the other worker's test loads both cores moves (a
bfloat16 CNN's measured 'memory' peak fell from 18.95 to 18.2 MiB beside another test).
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


_held = None  # (alone_or_beside_others': how this process holds the lock now)


def worker_run_id(config):
    """The run id of a pytest-xdist worker's `config`, or None outside a worker: a pytest
    that a test starts in a child process inherits the worker's environment
    (RUN_ID_ENV), not its workerinput."""
    return getattr(config, "workerinput", {}).get("testrunuid")


@contextlib.contextmanager
def alone_or_beside_others(run_id, alone):
    """Runs the block of one test of run `run_id` alone (`alone`: no other worker runs a
    test meanwhile) or beside other tests that are not alone.

    A readers-writer lock over two files: every test passes a turnstile, then holds the
    run lock shared (beside others) or exclusive (alone). A test waiting to run alone
    keeps the turnstile, so the other worker's next tests wait behind it instead of
    holding the shared lock again and again (it would never get its turn).
    """
    global _held
    directory = run_directory(run_id)
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "turnstile.lock"), "w") as turnstile, \
            open(os.path.join(directory, "running.lock"), "w") as running:
        # (each lock is released when its file closes, a failure included)
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        fcntl.flock(running, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        if not alone:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        _held = "alone" if alone else "beside others"
        try:
            yield
        finally:
            _held = None


def held():
    """How this process's running test holds the run's lock: "alone", "beside others",
    or None (no lock: not in a pytest-xdist worker)."""
    return _held
