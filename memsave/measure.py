"""Peak-memory and timing helpers shared by the tests and the benchmarks.

Peak memory on a CPU is only visible through TensorFlow's BFC allocator, which
must be switched on *before* TensorFlow is imported, and peaks of different
configurations mix if they share a process. So every configuration is measured in
a fresh Python process: `run_isolated("package.module:function", **kwargs)` runs
the function there with the allocator set up and returns what it returned (JSON).
The process is forked from a warm one that has imported TensorFlow but not started
it (`memsave.fresh_process`), which saves the seconds of an import per run.

On a machine with a GPU the memory of interest is the GPU's: `memory_device()`
picks "GPU:0" when one is present, and the same helpers read its allocator.

Memory caps, so a benchmark can show where plain `tf.gradients` runs out:
`memory_limit_env(mb)` is the environment for a child whose CPU (BFC) allocator
refuses to grow past `mb` (TensorFlow then raises ResourceExhaustedError, "OOM
when allocating tensor"); `apply_gpu_memory_limit(mb)`, called in the child
before the GPU is first used, does the same for GPU:0 with a virtual device.
`is_oom_failure(error)` tells an out-of-memory child from a crash.
"""

import json
import logging
import os
import signal
import time

from memsave import fresh_process

logger = logging.getLogger(__name__)

BFC_ENV = {"TF_CPU_ALLOCATOR_USE_BFC": "true", "TF_CPP_MIN_LOG_LEVEL": "2"}
CPU_MEMORY_LIMIT_ENV = "TF_CPU_BFC_MEM_LIMIT_IN_MB"
_OOM_MARKERS = ("ResourceExhaustedError", "OOM when allocating", "std::bad_alloc",
                "Out of memory", "out of memory")
_RESULT_MARKER = "MEMSAVE_RESULT_JSON:"

_CHILD = """
import importlib, json, sys
spec = json.loads(sys.argv[1])
module_name, function_name = spec["target"].split(":")
result = getattr(importlib.import_module(module_name), function_name)(**spec["kwargs"])
sys.stdout.write("\\n{marker}" + json.dumps(result) + "\\n")
"""


class IsolatedRunError(RuntimeError):
    """A configuration measured in its own process failed; carries its stderr.

    Attributes:
      returncode: the child's exit status (negative: killed by that signal;
        None: it ran past its timeout and was killed).
      stderr: the child's whole stderr.
    """

    def __init__(self, message, returncode=None, stderr=""):
        super().__init__(message)
        self.returncode = returncode
        self.stderr = stderr or ""


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
    proc = fresh_process.run_python(_CHILD.format(marker=_RESULT_MARKER), [spec], env=child_env,
                                    timeout=timeout)
    if proc.timed_out:
        raise IsolatedRunError(f"{target} ran past its timeout of {timeout} s",
                               returncode=None, stderr=proc.stderr)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(_RESULT_MARKER):
            return json.loads(line[len(_RESULT_MARKER):])
    raise IsolatedRunError(f"{target} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}",
                           returncode=proc.returncode, stderr=proc.stderr)


def _device_for_memory():
    import tensorflow as tf
    return "GPU:0" if tf.config.list_physical_devices("GPU") else "CPU:0"


def memory_device():
    """"GPU:0" when TensorFlow sees a GPU, else "CPU:0": the device whose peak is measured."""
    return _device_for_memory()


def memory_limit_env(limit_mb):
    """Environment for `run_isolated(env=...)` capping the child's CPU allocator at `limit_mb`.

    Empty when `limit_mb` is None. Takes effect only with the BFC allocator, which
    run_isolated always switches on.
    """
    if limit_mb is None:
        return {}
    return {CPU_MEMORY_LIMIT_ENV: str(int(limit_mb))}


# The first region TensorFlow's CPU BFC allocator reserves when it grows (tensorflow/
# core/common_runtime/bfc_allocator.cc: 2 MiB, or less under a smaller limit).
_FIRST_REGION_MB = 2


def reserve_one_region(limit_mb):
    """Makes a capped CPU allocator hold its whole cap as one region, as TensorFlow's GPU
    allocator does by default (it takes the GPU's memory in one piece unless memory
    growth is on), so that running under a cap shows what a step needs.

    The CPU BFC allocator grows region by region, each twice the last, and no buffer
    can span two regions: under a cap, a step whose largest buffer (an XLA program's one
    temporary buffer) does not fit in the room the earlier regions left fails although
    the cap holds it. Reserving nearly the whole cap first (an uninitialised tensor,
    dropped at once: the allocator keeps its region) leaves every later buffer to be cut
    from that one region. Call it first thing in a child, before anything is allocated.

    Args:
      limit_mb: the cap the child runs under (`memory_limit_env`), in MiB.
    Returns:
      The MiB reserved, or None where nothing was (no cap, or a GPU: its capped virtual
      device is one region already).
    """
    import tensorflow as tf
    if not limit_mb or tf.config.list_physical_devices("GPU"):
        return None
    # What TensorFlow allocated while starting takes a first region of 2 MiB (the BFC
    # allocator's first); try the largest reservation that fits beside it. Each try that
    # does not fit waits 10 s for memory to be freed before it fails (TensorFlow's
    # allocation retry), so the first try is the cap less that region: a try one MiB
    # larger never fitted (AMD EPYC, TensorFlow 2.16 and 2.21).
    for spare_mb in range(_FIRST_REGION_MB, 33):
        size_mb = int(limit_mb) - spare_mb
        if size_mb <= 0:
            break
        try:
            # (two dimensions: Empty's shape is int32, and 2 GiB or more in one overflows it)
            block = tf.raw_ops.Empty(shape=[size_mb, 1 << 20], dtype=tf.uint8, init=False)
        except tf.errors.ResourceExhaustedError:
            continue
        del block
        return size_mb
    return None


def apply_gpu_memory_limit(limit_mb):
    """Caps GPU:0 at `limit_mb` with a virtual device; returns False when there is no GPU.

    Must run before TensorFlow first uses the GPU (at the start of a child process).
    """
    import tensorflow as tf
    gpus = tf.config.list_physical_devices("GPU")
    if not gpus or limit_mb is None:
        return False
    tf.config.set_logical_device_configuration(
        gpus[0], [tf.config.LogicalDeviceConfiguration(memory_limit=int(limit_mb))])
    logger.info("GPU:0 capped at %d MiB", int(limit_mb))
    return True


def is_oom_failure(error):
    """Whether an IsolatedRunError looks like the child ran out of memory.

    True when the child was killed by SIGKILL (what the kernel's OOM killer sends)
    or its stderr names an allocation failure.
    """
    if getattr(error, "returncode", None) == -signal.SIGKILL:
        return True
    text = getattr(error, "stderr", "") or str(error)
    return any(marker in text for marker in _OOM_MARKERS)


def sync_devices():
    """Waits until queued device work is done (GPU kernels run asynchronously)."""
    import tensorflow as tf
    sync = getattr(getattr(tf.test, "experimental", None), "sync_devices", None)
    if sync is not None and tf.config.list_physical_devices("GPU"):
        sync()


def device_description():
    """A short description of the measured device, for result tables."""
    import platform

    import tensorflow as tf
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        details = tf.config.experimental.get_device_details(gpus[0])
        return f"GPU: {details.get('device_name', gpus[0].name)}"
    from memsave.graph import _tf_private
    model, flags = platform.processor() or platform.machine(), None
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and flags is None:
                    flags = line.split(":", 1)[1].split()
    except OSError:
        pass
    # Two CPUs of one name may differ in what decides the peaks: TensorFlow turns its
    # oneDNN kernels on by default only on some CPUs (among x86, only on CPUs with
    # AVX-512 features), and TensorFlow's own kernels hold other buffers.
    vector = "" if flags is None else (", AVX-512" if "avx512f" in flags else ", no AVX-512")
    kernels = "oneDNN on" if _tf_private.onednn_enabled() else "oneDNN off"
    # One inter-op thread runs one op at a time (as a GPU's stream): step times differ.
    from memsave import environment
    threads = environment.inter_op_threads_set()
    executor = f", {threads} inter-op thread{'s' * (threads > 1)}" if threads else ""
    return f"CPU: {model}, {os.cpu_count()} cores{vector}, {kernels}{executor}"


# The dtypes DecodeRaw reads (tensorflow/core/kernels/decode_raw_op.cc).
_RAW_DTYPES = ("float16", "bfloat16", "float32", "float64", "int8", "int16", "int32", "int64",
               "uint8", "uint16", "complex64", "complex128", "bool")


def device_input(value):
    """A step's input `value` (a NumPy array) as a tensor in memory the measured
    device's allocator gave.

    tf.constant of a NumPy array sometimes keeps its copy where the allocator never
    sees it (TensorFlow 2.21 on CPU: a 1 MiB array was in BFC after 4 conversions of
    6, at random), so a measured peak would count the inputs in some processes and not
    in others: 6.5 against 8.0-9.0 MiB for one plan of a small bfloat16 CNN. Decoded
    from its bytes on the CPU, or copied onto the GPU, it always is (on a GPU, an
    integer tensor stays in host memory, as TensorFlow keeps int32 there). A dtype
    DecodeRaw does not read (a string, uint32) is converted as tf.constant does.
    """
    import numpy as np
    import tensorflow as tf
    value = np.asarray(value, order="C")  # (a 0-d array stays one)
    device = _device_for_memory()
    if "GPU" in device:
        with tf.device(device):
            return tf.identity(value)
    try:
        dtype = tf.as_dtype(value.dtype)
    except TypeError:
        dtype = None
    if dtype is None or dtype.name not in _RAW_DTYPES:
        return tf.constant(value)
    native = value.astype(value.dtype.newbyteorder("="), copy=False)  # (DecodeRaw: host order)
    raw = tf.io.decode_raw(tf.constant(native.tobytes()), dtype)
    return tf.reshape(raw, value.shape)


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


def hlo_op_counts(function, *args, kinds=("dot", "convolution")):
    """How many ops of each kind the optimized HLO of a jit-compiled tf.function holds.

    Args:
      function: a tf.function(jit_compile=True).
      *args: the arguments to specialise it on.
      kinds: HLO opcodes to count.
    Returns:
      {kind: count}.
    """
    import re
    hlo = function.experimental_get_compiler_ir(*args)(stage="optimized_hlo")
    return {kind: len(re.findall(rf"\s{kind}\(", hlo)) for kind in kinds}


def xla_dump_env(directory):
    """Environment for a child process whose XLA compilations write their HLO and buffer
    assignment to `directory` (see `xla_buffer_bytes`)."""
    flags = os.environ.get("XLA_FLAGS", "")
    return {"XLA_FLAGS": f"{flags} --xla_dump_to={directory} --xla_dump_hlo_as_text".strip()}


def xla_buffer_bytes(directory):
    """The largest "Total bytes used" of the XLA buffer assignments dumped in `directory`
    (parameters, outputs and the temporary buffer of the biggest compiled module), or None.

    TensorFlow's allocator may hold more than this: BFC does not split a free chunk when
    what is left would be under 128 MiB, so the one large temporary buffer of an XLA
    step can occupy a chunk up to 128 MiB larger than itself.
    """
    import glob
    import re
    sizes = []
    # (Every TensorFlow version writes the buffer assignment; newer ones also a short
    # memory-usage report with the same total.)
    for path in glob.glob(os.path.join(directory, "*buffer-assignment.txt")):
        with open(path, encoding="utf-8") as handle:
            match = re.search(r"^Total bytes used: (\d+)", handle.read(), re.MULTILINE)
        if match:
            sizes.append(int(match.group(1)))
    return max(sizes) if sizes else None


def time_calls(fn, repeats=5, warmup=1):
    """Median wall time of `fn()` in seconds, after `warmup` untimed calls."""
    times = sorted(time_each_call(fn, repeats, warmup))
    return times[len(times) // 2]


def time_each_call(fn, repeats=5, warmup=1):
    """Wall time of each of `repeats` calls of `fn()` in seconds, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def time_paired(fn, reference, repeats=5, warmup=1):
    """Times `fn()` and `reference()` side by side, alternating, so load affects both alike.

    Each round calls both, in alternating order (fn first on even rounds), so a
    slow drift in machine load (other processes on shared cores) cancels out in
    the ratio.

    Returns:
      (median time of fn, median time of reference, median of the per-round
      ratios fn/reference), in seconds.
    """
    for _ in range(warmup):
        fn()
        reference()
    mine, theirs = [], []
    for round_index in range(repeats):
        order = ((fn, mine), (reference, theirs))
        for call, times in (order if round_index % 2 == 0 else order[::-1]):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
    ratios = sorted(a / b for a, b in zip(mine, theirs))
    return (sorted(mine)[len(mine) // 2], sorted(theirs)[len(theirs) // 2],
            ratios[len(ratios) // 2])
