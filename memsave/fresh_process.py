"""Fresh processes for measurements, forked from a warm one.

A peak must be measured in a process of its own (the BFC allocator's peak never goes
down, and it must be switched on before TensorFlow starts), and starting Python and
importing TensorFlow takes 3-6 s on a 2-core AMD EPYC: more than most measured steps.
So `run_python` keeps a warm process, a *zygote*, that has imported TensorFlow (and
Keras, NumPy) but not started TensorFlow's runtime (no eager context, no session, no
thread pool: what would make forking unsafe), and forks it once per run. Each child
starts with an empty allocator and a runtime of its own, as a new interpreter would,
in a few milliseconds.

The environment: variables that TensorFlow, Keras or Python may read while they are
imported choose the zygote (one per distinct set, the last two kept); those read later
are set in the child: the CPU allocator's cap, XLA_FLAGS, PYTHONPATH (applied to
`sys.path` as the interpreter would), and names of memsave's and pytest's own
(MEMSAVE_*, PYTEST_*). Where fork is missing, the zygote cannot start, or
MEMSAVE_FRESH_PROCESS=spawn, every run starts a new interpreter instead.

How a child differs from a new interpreter: it shares the zygote's hash seed and
NumPy's global random state (every child starts from the same one: seed what you
measure), and what TensorFlow logs while it is imported is not in its stderr. It runs
in a `__main__` of its own, runs its exit handlers and waits for its threads as the
interpreter would, and dies with the zygote. Each zygote holds about 0.6 GB (TensorFlow
and Keras imported); a process keeps at most two.
"""

import atexit
import collections
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading

logger = logging.getLogger(__name__)

MODE_ENV = "MEMSAVE_FRESH_PROCESS"  # "fork" (default where os.fork exists) or "spawn"
PRELOADED = ("numpy", "tensorflow", "keras")
# Read after the imports above, so a child may set them: the CPU BFC allocator's cap
# (read when the allocator is made), XLA's flags (read at the first compilation), and
# PYTHONPATH (the child puts it on sys.path itself).
LATE_VARIABLES = frozenset({"TF_CPU_BFC_MEM_LIMIT_IN_MB", "XLA_FLAGS", "PYTHONPATH"})
LATE_PREFIXES = ("MEMSAVE_", "PYTEST_")
_ZYGOTES_KEPT = 2

Completed = collections.namedtuple("Completed", "returncode stdout stderr timed_out")

_ZYGOTE = r"""
import atexit, json, os, sys, threading, time, traceback, types
preloaded = json.loads(sys.argv[1])
for name in preloaded:
    if name == "keras" and os.environ.get("KERAS_BACKEND", "tensorflow") != "tensorflow":
        continue  # another backend may start its own threads when imported
    try:
        __import__(name)
    except ImportError:
        pass
from tensorflow.python.eager import context
why = ("TensorFlow's runtime started on import" if context.context_safe() is not None else
       "a Python thread started on import" if threading.active_count() > 1 else None)
sys.stdout.write(json.dumps({"ready": why is None, "why": why}) + "\n")
sys.stdout.flush()
if why is not None:
    sys.exit(0)
base_path = list(sys.path)


def die_with_the_zygote():
    try:  # Linux: the child is killed when the warm process ends (PR_SET_PDEATHSIG)
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, 9)
    except (OSError, AttributeError):
        pass


def run_child(request):
    die_with_the_zygote()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(out, fd)
        os.close(out)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = base_path[:1] + [os.path.abspath(p) for p in extra] + base_path[1:]
    sys.argv = request["argv"]
    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    code = 0
    try:
        exec(compile(request["code"], "<string>", "exec"), main.__dict__)
        for thread in threading.enumerate():  # as the interpreter does at exit
            if thread is not threading.main_thread() and not thread.daemon:
                thread.join()
        atexit._run_exitfuncs()
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
        if not isinstance(done.code, (int, type(None))):
            sys.stderr.write(str(done.code) + "\n")
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


for line in sys.stdin:
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:
        run_child(request)
    timeout = request["timeout"]
    deadline = time.monotonic() + (timeout if timeout is not None else float("inf"))
    timed_out = False
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            _, status = os.waitpid(pid, 0)
            timed_out = True
            break
        time.sleep(0.005)
    reply = {"id": request["id"], "returncode": os.waitstatus_to_exitcode(status),
             "timed_out": timed_out}
    sys.stdout.write(json.dumps(reply) + "\n")
    sys.stdout.flush()
"""

_LOST = "memsave: the warm process this run was forked from exited during the run"


class _Zygote:
    """One warm interpreter that forks a child per request (see the module docstring)."""

    def __init__(self, env, cwd):
        zygote_env = {k: v for k, v in env.items() if k != "PYTHONPATH"}
        self.owner_pid = os.getpid()  # a forked copy of this process must not share it
        self._lock = threading.Lock()
        self._requests = 0
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _ZYGOTE, json.dumps(PRELOADED)], cwd=cwd, env=zygote_env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        hello = self._read_reply()
        if not hello or not hello.get("ready"):
            self.close()
            raise OSError(f"the warm process did not start: {hello and hello.get('why')}")

    def _read_reply(self):
        line = self._proc.stdout.readline()
        return json.loads(line) if line else None

    def run(self, code, argv, env, cwd, timeout):
        """Forks a child for `code`. Raises OSError only where the child never ran (the
        request could not be sent, or the zygote ended before the child began): the
        caller may start a new interpreter instead. A zygote that ends during a run
        gives that run as killed (-SIGKILL), never a second run."""
        with self._lock, tempfile.TemporaryDirectory(prefix="memsave-child-") as folder:
            paths = {name: os.path.join(folder, name) for name in ("stdout", "stderr")}
            self._requests += 1
            request = dict(paths, id=self._requests, code=code, argv=argv, env=env, cwd=cwd,
                           timeout=timeout)
            self._proc.stdin.write(json.dumps(request) + "\n")
            self._proc.stdin.flush()
            try:
                reply = self._read_reply()
            except ValueError:  # not a reply: treated as a lost one below
                reply = None
            except BaseException:  # interrupted: its reply would answer the next request
                self._kill()
                raise
            outputs = {}
            for name, path in paths.items():
                with open(path, encoding="utf-8", errors="replace") as stream:
                    outputs[name] = stream.read()
        if reply is None or reply.get("id") != request["id"]:
            # The child ran, or began to: not run again elsewhere.
            self._kill()
            return Completed(-signal.SIGKILL, outputs["stdout"],
                             outputs["stderr"] + "\n" + _LOST + "\n", False)
        return Completed(reply["returncode"], outputs["stdout"], outputs["stderr"],
                         reply["timed_out"])

    def alive(self):
        return self._proc.poll() is None

    def _kill(self):
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()

    def close(self):
        if self.owner_pid != os.getpid():
            return  # the process that started it closes it
        with self._lock:  # after a run in flight in another thread
            self._close()

    def _close(self):
        if self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()


_zygotes = collections.OrderedDict()  # key -> _Zygote, least recently used first
_zygotes_lock = threading.Lock()
_unstartable = set()  # keys whose warm process could not start: spawn those


def _zygote_key(env):
    """The part of `env` a child cannot change after the preloaded imports."""
    return tuple(sorted((k, v) for k, v in env.items()
                        if k not in LATE_VARIABLES and not k.startswith(LATE_PREFIXES)))


def _zygote_for(env, cwd):
    key = _zygote_key(env)
    with _zygotes_lock:
        if key in _unstartable:
            raise OSError("its warm process could not start before")
        zygote = _zygotes.pop(key, None)
        if zygote is not None and zygote.owner_pid == os.getpid() and not zygote.alive():
            zygote = None  # it ended (killed, or ran out of memory): start another
        if zygote is None or zygote.owner_pid != os.getpid():
            try:
                zygote = _Zygote(env, cwd)
            except OSError:
                _unstartable.add(key)
                raise
        _zygotes[key] = zygote
        while len(_zygotes) > _ZYGOTES_KEPT:
            _zygotes.popitem(last=False)[1].close()
    return zygote


def _drop_zygote(env):
    with _zygotes_lock:
        zygote = _zygotes.pop(_zygote_key(env), None)
    if zygote is not None:
        zygote.close()


@atexit.register
def close_all():
    """Ends every warm process (they also end when this process does)."""
    with _zygotes_lock:
        while _zygotes:
            _zygotes.popitem()[1].close()


def _forking_enabled():
    mode = os.environ.get(MODE_ENV, "fork")
    if mode not in ("fork", "spawn"):
        from memsave.errors import MemsaveError
        raise MemsaveError(f"unknown {MODE_ENV}={mode!r}; expected 'fork' (children forked "
                           "from a warm process) or 'spawn' (a new interpreter per run)")
    return mode == "fork" and hasattr(os, "fork")


def _spawn(code, args, env, timeout):
    try:
        proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True,
                              text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as expired:
        stderr = expired.stderr or ""
        if isinstance(stderr, bytes):
            stderr = stderr.decode(errors="replace")
        return Completed(None, "", stderr, True)
    return Completed(proc.returncode, proc.stdout, proc.stderr, False)


def run_python(code, args=(), env=None, timeout=600):
    """Runs `python -c code *args` in a fresh process, forked from a warm one if it can.

    Args:
      code: Python source, run as the `__main__` module of the child.
      args: strings for the child's sys.argv[1:].
      env: the child's whole environment (default: this process's).
      timeout: seconds before the child is killed.
    Returns:
      Completed(returncode, stdout, stderr, timed_out): returncode is negative when a
      signal killed the child, None when it was killed for running past `timeout`.
    """
    env = dict(os.environ if env is None else env)
    args = [str(a) for a in args]
    if _forking_enabled():
        try:
            done = _zygote_for(env, os.getcwd()).run(code, ["-c", *args], env, os.getcwd(),
                                                      timeout)
            return done._replace(returncode=None) if done.timed_out else done
        except (OSError, ValueError) as failure:
            logger.info("memsave: forking a warm process failed (%s); starting a new one",
                        failure)
            _drop_zygote(env)
    return _spawn(code, args, env, timeout)
