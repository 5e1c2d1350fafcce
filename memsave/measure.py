"""Peak-memory and timing helpers shared by the tests and the benchmarks.

Peak memory on a CPU is only visible through TensorFlow's BFC allocator, which
must be switched on *before* TensorFlow is imported, and peaks of different
configurations mix if they share a process. So every configuration is measured in
a fresh Python process: `run_isolated("package.module:function", **kwargs)` runs
the function there with the allocator set up and returns what it returned (JSON).
"""

import json
import os
import subprocess
import sys
import time

BFC_ENV = {"TF_CPU_ALLOCATOR_USE_BFC": "true", "TF_CPP_MIN_LOG_LEVEL": "2"}
_RESULT_MARKER = "MEMSAVE_RESULT_JSON:"

_CHILD = """
import importlib, json, sys
spec = json.loads(sys.argv[1])
module_name, function_name = spec["target"].split(":")
result = getattr(importlib.import_module(module_name), function_name)(**spec["kwargs"])
sys.stdout.write("\\n{marker}" + json.dumps(result) + "\\n")
"""


class IsolatedRunError(RuntimeError):
    """A configuration measured in its own process failed; carries its stderr."""


def run_isolated(target, timeout=600, env=None, **kwargs):
    """Runs `target` ("module:function") in a fresh process with the BFC allocator on.

    Args:
      target: "importable.module:function"; the function takes JSON-able kwargs
        and returns a JSON-able value.
      timeout: seconds before the child is killed.
      env: extra environment variables for the child.
      **kwargs: passed to the function.
    Returns:
      The function's return value, decoded from JSON.
    Raises:
      IsolatedRunError: if the child fails (its stderr tail is in the message).
    """
    child_env = dict(os.environ, **BFC_ENV, **(env or {}))
    spec = json.dumps({"target": target, "kwargs": kwargs})
    proc = subprocess.run([sys.executable, "-c", _CHILD.format(marker=_RESULT_MARKER), spec],
                          capture_output=True, text=True, timeout=timeout, env=child_env)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(_RESULT_MARKER):
            return json.loads(line[len(_RESULT_MARKER):])
    raise IsolatedRunError(f"{target} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")


def _device_for_memory():
    import tensorflow as tf
    return "GPU:0" if tf.config.list_physical_devices("GPU") else "CPU:0"


def peak_memory_bytes(fn, device=None):
    """Runs `fn()` once and returns (peak bytes allocated during it, fn's result).

    On CPU this needs TF_CPU_ALLOCATOR_USE_BFC=true set before TensorFlow was
    imported (run_isolated does that); without it TensorFlow reports nothing.
    """
    import tensorflow as tf
    device = device or _device_for_memory()
    tf.config.experimental.reset_memory_stats(device)
    result = fn()
    return tf.config.experimental.get_memory_info(device)["peak"], result


def time_calls(fn, repeats=5, warmup=1):
    """Median wall time of `fn()` in seconds, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]
