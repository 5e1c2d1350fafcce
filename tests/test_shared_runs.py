"""The suite's own machinery for pytest-xdist (tests/_shared_runs.py): a test marked
`measures` runs alone, and a worker's stream of other tests cannot keep it waiting."""

import fcntl
import os
import threading
import time
import uuid

import pytest

from _shared_runs import (alone_or_beside_others, held, remove_run_directory, run_directory,
                          worker_run_id)

WAIT = 0.5  # seconds a blocked test is given to show that it did not get in


class _Test:
    """A test of run `run_id` in a thread of its own, holding the run's lock until left."""

    def __init__(self, run_id, alone):
        self.entered, self._leave = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, args=(run_id, alone), daemon=True)
        self._thread.start()

    def _run(self, run_id, alone):
        with alone_or_beside_others(run_id, alone):
            self.entered.set()
            self._leave.wait(30)

    def leave(self):
        self._leave.set()
        self._thread.join(10)


def _wait_until_taken(path, seconds=10):
    """Returns once another holder has the lock file at `path`."""
    deadline = time.monotonic() + seconds
    with open(path, "w") as lock:
        while time.monotonic() < deadline:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return
            fcntl.flock(lock, fcntl.LOCK_UN)
            time.sleep(0.01)
    raise AssertionError(f"nothing took {path} in {seconds} s")


def test_a_measuring_test_waits_for_running_tests_then_runs_before_later_ones():
    run_id = f"test-{uuid.uuid4().hex}"
    try:
        first, second = _Test(run_id, alone=False), _Test(run_id, alone=False)
        assert first.entered.wait(10) and second.entered.wait(10)  # (side by side)
        measuring = _Test(run_id, alone=True)
        assert not measuring.entered.wait(WAIT)  # (waits while others run)
        _wait_until_taken(os.path.join(run_directory(run_id), "turnstile.lock"))
        later = _Test(run_id, alone=False)
        assert not later.entered.wait(WAIT)  # (queued behind it, not beside the others)
        first.leave()
        assert not measuring.entered.wait(WAIT)  # (the second still runs)
        second.leave()
        assert measuring.entered.wait(10)
        assert not later.entered.wait(WAIT)  # (nothing beside the measuring test)
        measuring.leave()
        assert later.entered.wait(10)
        later.leave()
    finally:
        remove_run_directory(run_id)


def _in_a_worker(request):
    if not worker_run_id(request.config):
        pytest.skip("not in a pytest-xdist worker (pytest -n 2)")


def test_under_xdist_a_test_runs_beside_others(request):
    """The suite's command runs two workers (README): each test holds the run's lock
    (conftest.pytest_runtest_protocol), so a measuring test cannot start beside it."""
    _in_a_worker(request)
    assert held() == "beside others"


@pytest.mark.measures
def test_under_xdist_a_measuring_test_runs_alone(request):
    _in_a_worker(request)
    assert held() == "alone"
