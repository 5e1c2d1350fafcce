"""tf.gradients against memsave's strategies, side by side, each in its own process.

    python benchmarks/compare.py                       # ResNet-style CNN, default sizes
    python benchmarks/compare.py --model mlp --steps 10 --csv mlp.csv --markdown mlp.md
    python benchmarks/compare.py --sweep --depths 6,12,24,48 --memory-limit-mb 400
    python benchmarks/compare.py --build-time          # rewrite time on generated graphs
    python benchmarks/compare.py --budget-sweep        # memsave.budget(F): peak against time
    python benchmarks/compare.py --model gpt2 --repeat 5   # each ratio's median and range

Every configuration (model, depth, strategy) runs in a fresh Python process
(`memsave.measure.run_isolated`) with TensorFlow's BFC allocator on, so peaks do
not mix. In that process: build the model (seeded: the same weights and data in
every process), trace the training step, run it once (Grappler and executor
setup), `--warmup` more times, then two steps while the allocator records its
peak. The gradients of the first step are saved and compared, in the parent,
with tf.gradients's from its own process. Then the timing: a memsave strategy's
process also builds the plain tf.gradients step (after the peak was taken) and
runs the two alternately for `--steps` rounds, so that load from other processes
on shared cores hits both alike (`--no-paired`: time each process alone).

Columns of the table:
  peak MiB    the allocator's peak during a step (GPU:0 when a GPU is present,
              else CPU), including weights, data and gradients;
  x tf        that peak divided by tf.gradients's (from its own process);
  predicted MiB the memory model's prediction of that peak (memsave.plan; for
              tf.gradients, RewriteReport.baseline_peak_bytes), and its error;
  step ms     median wall time of one step (forward, loss, gradients);
  x tf        median over the rounds of (this step / tf.gradients's step), timed
              side by side in the same process;
  pred x      that ratio as the cost model predicts it (report.step_time_ratio: the
              recomputation priced per FLOP and per element, over a step of three
              forward passes; what the rewrite costs beyond it is not in it);
  max rel err max over variables of max|g - g_tf| / max|g_tf|;
  build s     seconds spent inside the gradient function while tracing
              (tf.gradients itself, or memsave's whole rewrite);
  ckpts       checkpoints memsave kept (from memsave.last_report()).
With --fit, two more:
  fits MiB    the smallest cap (within 3%) under which the step runs: what the step
              needs. The peak above may count allocator chunks it did not split (one
              XLA program's temporary buffer can sit in a chunk far larger than
              itself), or leave out fragmentation (under a cap each buffer must fit in
              one free chunk); see `fitting_cap`;
  x tf        that divided by tf.gradients's.
With --repeat N, the whole comparison runs N times (each strategy in a fresh process
each time) and a last table gives, per strategy, the median and the range over the runs
of the peak, its ratio and the step-time ratio (the table's: paired unless --no-paired):
one run's time ratio moves by a few hundredths from run to run on a shared 2-core
machine, more than the differences the benchmarks are asked to show. --csv then holds
every run's rows (a `run` column), --markdown the last run's table and the summary.
"""

import argparse
import csv
import logging
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from memsave import measure  # noqa: E402

logger = logging.getLogger("memsave.benchmarks")

BASELINE = "tf.gradients"
MEMSAVE_STRATEGIES = ("speed", "memory", "collection")
# Mirrors of models.py, so the parser needs no TensorFlow (a test checks they agree):
# every model, those whose forward pass marks checkpoints, those built from Keras layers,
# the mixed-precision policies.
MODELS = ("cnn", "mlp", "calls", "transformer", "keras", "vit", "gpt", "gpt2", "lstm", "unet")
MARKING_MODELS = ("cnn", "mlp", "calls", "transformer")
KERAS_MODELS = ("keras", "vit", "gpt", "gpt2", "lstm", "unet")
MIXED_PRECISION = ("float16", "bfloat16")
DEFAULT_SWEEP_DEPTHS = {"cnn": (6, 12, 24, 48, 81), "mlp": (8, 16, 32, 64, 128),
                        "calls": (8, 16, 32, 64),
                        "transformer": (2, 4, 8, 16, 32), "keras": (0,), "vit": (2, 4, 8, 16),
                        "gpt": (2, 4, 6, 12), "gpt2": (2, 4, 6, 12), "lstm": (1, 2, 4), "unet": (2, 3, 4)}
CHILD_TARGET = "benchmarks.compare:measure_config"
MEMORY_STEPS = 2  # steps over which the peak is taken
# ... for --predict-table: the peak of the same plan moves from step to step (the
# executor's order, where the allocator places each buffer: 35.9-40.3 MiB on the nested
# calls' 'memory' plan, benchmarks/step_peaks.py), and a budget must hold for every step.
PREDICT_MEMORY_STEPS = 8

TABLE_COLUMNS = ("strategy", "peak MiB", "x tf", "predicted MiB", "pred err", "step ms", "x tf",
                 "pred x", "max rel err", "build s", "ckpts")
CSV_FIELDS = ("model", "depth", "batch", "strategy", "status", "peak_mb", "peak_ratio",
              "predicted_mb", "predicted_error", "predicted_range", "range_error",
              "recompute_fraction",
              "resting_mb", "step_ms", "time_ratio", "predicted_time_ratio", "paired_base_step_ms",
              "time_ratio_separate", "max_rel_err", "grad_build_s", "trace_s", "first_call_s",
              "checkpoints", "copied_ops", "graph_ops", "xla_buffer_mb", "fits_mb", "fits_ratio",
              "device", "message")
FIT_COLUMNS = ("fits MiB", "x tf")
FIT_TOLERANCE = 1.03  # the cap found is within 3% of the smallest one the step runs under


# ----------------------------------------------------------------------------- child side

def _strategy_gradient_fn(strategy, model, offload=False):
    """(grad_fn(ys, xs), timings dict) for a strategy name; timings gets 'grad_build_s'.
    `offload` goes to every memsave call (memsave.offload). A memsave strategy may end
    in '+chunk:K' (K an int or 'auto'): its calls made under
    memsave.recompute_loops(chunk=K)."""
    strategy, chunked, chunk = strategy.partition(LOOP_CHUNK)
    if chunked:
        grad_fn, timings = _strategy_gradient_fn(strategy, model, offload)
        return _with_loop_chunk(grad_fn, chunk), timings
    import tensorflow as tf

    import memsave

    if strategy == BASELINE:
        def compute(ys, xs):
            return tf.gradients(ys, xs)
    elif strategy in MEMSAVE_STRATEGIES:
        def compute(ys, xs):
            return memsave.gradients(ys, xs, checkpoints=strategy, offload=offload)
    elif strategy.startswith(BUDGETS):
        budget = budget_of(strategy)

        def compute(ys, xs):
            return memsave.gradients(ys, xs, checkpoints=budget, offload=offload)
    elif strategy.startswith(CALIBRATED_BUDGET + ":"):
        limit = _budget_limit(strategy)

        def compute(ys, xs):  # (_measure calibrates the step first: CALIBRATION holds it)
            budget = memsave.budget(limit, calibration=CALIBRATION.get("measured"))
            return memsave.gradients(ys, xs, checkpoints=budget, offload=offload)
    elif strategy.startswith("every:"):
        every = int(strategy.split(":", 1)[1])
        if every < 1:
            raise ValueError(f"every:K needs K >= 1, got {strategy!r}")

        def compute(ys, xs):
            chosen = model.block_outputs[every - 1::every]
            return memsave.gradients(ys, xs, checkpoints=chosen, offload=offload)
    elif strategy.partition(":")[0] in TAPE_KINDS and strategy.partition(":")[2] in MEMSAVE_STRATEGIES:
        return _tape_gradient_fn(strategy, offload)
    elif strategy.startswith(REMAT + ":") and strategy.partition(":")[2] in REMAT_MODES:
        return _tape_gradient_fn(strategy, offload)
    else:
        raise ValueError(f"unknown strategy {strategy!r}; use {BASELINE}, "
                         f"{', '.join(MEMSAVE_STRATEGIES)}, budget:F, time:T, calibrated-budget:F, "
                         "every:K, tape:S or patched-tape:S (S a strategy name)")

    timings = {"grad_build_s": 0.0}

    def grad_fn(ys, xs):
        if strategy == BASELINE:
            # The memory model's prediction for plain tf.gradients (adds no ops; untimed).
            report = memsave.plan(ys, xs, [])
            timings["predicted_peak_bytes"] = report.baseline_peak_bytes
            timings["predicted_peak_range"] = report.baseline_peak_range
        start = time.perf_counter()
        result = compute(ys, xs)
        timings["grad_build_s"] += time.perf_counter() - start
        return result

    return grad_fn, timings


LOOP_CHUNK = "+chunk:"


def _with_loop_chunk(grad_fn, chunk):
    """grad_fn called under memsave.recompute_loops(chunk=chunk), the mode left as it is."""
    import memsave

    if chunk != "auto" and not chunk.isdigit():
        raise ValueError(f"+chunk:{chunk}: K is an int >= 1 or 'auto'")
    chunk = chunk if chunk == "auto" else int(chunk)

    def chunked(ys, xs):
        with memsave.recompute_loops(None, chunk=chunk):
            return grad_fn(ys, xs)

    return chunked


# 'calibrated-budget:F': memsave.budget(F, calibration=...) with the step measured first
# by memsave.calibrate_memory (in the same child, before the step is traced).
CALIBRATED_BUDGET = "calibrated-budget"
CALIBRATION = {}

# A training step written with a GradientTape: 'tape:S' records it on a
# memsave.GradientTape(checkpoints=S); 'patched-tape:S' on a plain tf.GradientTape with
# the step traced under memsave.patch(checkpoints=S).
TAPE_KINDS = ("tape", "patched-tape")
# Keras' own rematerialisation: 'remat:MODE' builds the Keras model inside
# keras.RematScope(mode=MODE) (tf.recompute_grad per layer on this backend) and takes
# the step's gradients with a plain tf.GradientTape, as Keras' fit does.
REMAT = "remat"
REMAT_MODES = ("full", "activations", "larger_than")


def _tape_gradient_fn(strategy, offload=False):
    """(grad_fn, timings) of a 'tape:S' or 'patched-tape:S' config (see TAPE_KINDS):
    grad_fn carries the tape to record the step on (models.BenchModel.make_step)."""
    import tensorflow as tf

    import memsave

    kind, name = strategy.split(":", 1)
    timings = {"grad_build_s": 0.0}

    def grad_fn(ys, xs):  # (not called: the step records on grad_fn.tape)
        raise AssertionError("a tape config records its forward pass on a tape")

    if kind == "tape":
        grad_fn.tape = lambda: memsave.GradientTape(checkpoints=name, offload=offload)
    elif kind == REMAT:
        grad_fn.tape = lambda: tf.GradientTape()
    else:
        grad_fn.tape = lambda: tf.GradientTape()  # (looked up while the patch is active)
        grad_fn.context = lambda: memsave.patch(checkpoints=name, offload=offload)

    def gradient(tape, ys, xs):
        start = time.perf_counter()
        result = tape.gradient(ys, xs)
        timings["grad_build_s"] += time.perf_counter() - start
        return result
    grad_fn.gradient = gradient
    return grad_fn, timings


TIME_BUDGET = "time:"
BUDGETS = ("budget:", TIME_BUDGET)  # (the prefixes budget_of reads)


def budget_of(strategy):
    """memsave.budget of 'budget:F' or 'budget:NMiB' (_budget_limit), or of 'time:T':
    the lowest predicted peak within T times tf.gradients' predicted step time
    (memsave.budget(time=T))."""
    import memsave

    if strategy.startswith(TIME_BUDGET):
        try:
            return memsave.budget(time=float(strategy[len(TIME_BUDGET):]))
        except ValueError:
            raise ValueError(f"{strategy!r}: use time:T with a step-time ratio T, e.g. "
                             "time:1.2") from None
    return memsave.budget(_budget_limit(strategy))


def _budget_limit(strategy):
    """The limit of 'budget:F' (a fraction of tf.gradients' peak) or 'budget:NMiB' (bytes,
    N * 2**20; 'budget:NMB' is read the same)."""
    text = strategy.split(":", 1)[1]
    try:
        for unit in ("MIB", "MB"):
            if text.upper().endswith(unit):
                return int(float(text[:-len(unit)]) * 2**20)
        return float(text)
    except ValueError:
        raise ValueError(f"{strategy!r}: use budget:F with a fraction F in (0, 1] or "
                         "budget:NMiB") from None


def _report_summary(strategy):
    """Checkpoint count and summary line of memsave's latest rewrite, if it reports one."""
    if strategy == BASELINE:
        return {}
    import memsave

    report = memsave.last_report() if hasattr(memsave, "last_report") else None
    if report is None:
        return {}
    summary = {}
    checkpoints = getattr(report, "checkpoints", None)
    if checkpoints is not None:
        summary["checkpoints"] = len(checkpoints)
    summary["offloaded"] = len(set(getattr(report, "offloaded", ())))
    for field in ("copied_ops", "kept_bytes", "recomputed_bytes", "fallback",
                  "predicted_peak_bytes", "baseline_peak_bytes", "recompute_fraction",
                  "offload_moved_bytes", "calibrated_peak_bytes", "predicted_peak_range"):
        value = getattr(report, field, None)
        if value is not None:
            summary[field] = value
    if getattr(report, "step_time_ratio", None) is not None:
        summary["predicted_time_ratio"] = report.step_time_ratio
    if hasattr(report, "summary"):
        summary["report"] = report.summary()
    return summary


def _gradient_arrays(grads):
    """numpy arrays of a step's gradients (IndexedSlices densified), and their kinds."""
    import tensorflow as tf

    arrays, kinds = [], []
    for grad in grads:
        if grad is None:
            arrays.append(None)
            kinds.append("none")
        elif isinstance(grad, tf.IndexedSlices):
            arrays.append(tf.convert_to_tensor(grad).numpy())
            kinds.append("sparse")
        else:
            arrays.append(grad.numpy())
            kinds.append("dense")
    return arrays, kinds


def measure_config(model="cnn", depth=None, batch=None, strategy=BASELINE, steps=5, warmup=2,
                   seed=0, grads_path=None, memory_limit_mb=None, model_options=None,
                   paired=True, grappler=True, jit=False, xla_dump=None, offload=False,
                   one_region=False, memory_steps=MEMORY_STEPS):
    """One configuration, measured in the current (fresh) process; returns a JSON-able dict.

    jit=True compiles the step (and the paired tf.gradients step) with XLA and records
    how many dot and convolution ops its optimized HLO holds (`hlo_ops`); with
    `xla_dump`, the directory XLA_FLAGS makes XLA dump to, also the bytes of its buffer
    assignment (`xla_buffer_bytes`).

    Order: build and trace the step, run it once (its gradients are saved to
    `grads_path`), `warmup` more times, then `memory_steps` steps while the allocator
    records its peak. Only then, with paired=True and a memsave strategy, a plain
    tf.gradients step is built in the same process and the two are timed
    alternately for `steps` rounds (step_s, paired_base_step_s, paired_ratio);
    otherwise `steps` steps are timed alone (step_s: their median).

    one_region=True (with `memory_limit_mb`) first reserves the whole cap as one region,
    as a GPU's allocator holds its memory (`memsave.measure.reserve_one_region`).

    Out of memory (ResourceExhaustedError, e.g. under `memory_limit_mb`) is a result:
    {"status": "OOM", ...}; so is a memsave refusal ({"status": "error", ...}).
    """
    import tensorflow as tf

    if memory_limit_mb:
        measure.apply_gpu_memory_limit(memory_limit_mb)
        if one_region:
            measure.reserve_one_region(memory_limit_mb)
    if not grappler:
        tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": True})
    import memsave

    result = {"model": model, "strategy": strategy, "device": measure.device_description()}
    try:
        result.update(_measure(model, depth, batch, strategy, steps, warmup, seed, grads_path,
                               model_options or {}, paired, jit, xla_dump, offload,
                               memory_steps))
        result["status"] = "ok"
    except tf.errors.ResourceExhaustedError as error:
        result.update(status="OOM", message=_oom_line(error.message))
    except memsave.MemsaveError as error:
        result.update(status="error", message=_first_line(str(error)))
    return result


def _error_line(stderr):
    """What a child's traceback says went wrong: the message of its last exception (the
    line naming the error type, and Keras' bold message line where there is one), not
    Keras' '• argument=value' lines after it."""
    lines = [line.strip() for line in str(stderr).splitlines() if line.strip()]
    telling = [line for line in lines if not line.startswith(("•", "File ", "^", "~"))]
    bold = [line for line in telling if line.startswith("\x1b[1m")]
    if bold:
        return bold[-1].replace("\x1b[1m", "").replace("\x1b[0m", "")[:300]
    errors = [line for line in telling if "Error" in line.split(":", 1)[0]]
    return (errors or telling or [""])[-1][:300]


def _oom_line(text):
    for line in str(text).splitlines():
        if "OOM when allocating" in line:
            return line.strip()[:200]
    return _first_line(text)


def _first_line(text):
    """The first line of an error that says something (Keras lists the call's arguments
    as '• name=value' lines before its message)."""
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    telling = [line for line in lines if not line.startswith("•")]
    return (telling or lines or [""])[0][:300]


def _measure(model_name, depth, batch, strategy, steps, warmup, seed, grads_path, model_options,
             paired, jit=False, xla_dump=None, offload=False, memory_steps=MEMORY_STEPS):
    import numpy as np
    import tensorflow as tf

    from benchmarks.models import build_model

    tf.random.set_seed(seed)
    device = measure.memory_device()
    if strategy.startswith(REMAT + ":"):
        if model_name not in KERAS_MODELS:
            raise ValueError(f"{strategy!r}: keras.RematScope applies to Keras layers; use it "
                             f"with --model {', '.join(KERAS_MODELS)}")
        model_options = dict(model_options, remat=strategy.partition(":")[2])
    model = build_model(model_name, depth=depth, batch=batch, seed=seed, **model_options)
    out = {"description": model.description, "parameters": model.num_parameters(),
           "marks_checkpoints": model.marks_checkpoints,
           "depth": depth, "batch": int(model.inputs[0].shape[0]),
           "weights_checksum": float(sum(np.abs(v.numpy()).sum(dtype=np.float64)
                                         for v in model.variables))}
    grad_fn, timings = _strategy_gradient_fn(strategy, model, offload)
    step = model.make_step(grad_fn, jit_compile=jit)
    inputs = [measure.device_input(array) for array in model.inputs]
    if strategy.startswith(CALIBRATED_BUDGET + ":"):
        import memsave
        start = time.perf_counter()
        CALIBRATION["measured"] = memsave.calibrate_memory(step, *inputs)
        out["calibrate_s"] = time.perf_counter() - start
        timings["grad_build_s"] = 0.0  # (the calibration's own trace is not the step's)
        out["calibrated_baseline_bytes"] = CALIBRATION["measured"].peak_bytes

    start = time.perf_counter()
    concrete = step.get_concrete_function(*inputs)
    out["trace_s"] = time.perf_counter() - start
    out["grad_build_s"] = timings["grad_build_s"]
    out["graph_ops"] = len(concrete.graph.get_operations())
    out.update(_report_summary(strategy))
    for field in ("predicted_peak_bytes", "predicted_peak_range"):
        if timings.get(field) is not None:
            out[field] = timings[field]

    start = time.perf_counter()
    loss, grads = step(*inputs)
    measure.sync_devices()
    out["first_call_s"] = time.perf_counter() - start
    if jit:
        out["hlo_ops"] = measure.hlo_op_counts(step, *inputs)
    if xla_dump:  # before anything else is compiled in this process
        out["xla_buffer_bytes"] = measure.xla_buffer_bytes(xla_dump)
    out["loss"] = float(loss)
    arrays, out["grad_kinds"] = _gradient_arrays(grads)
    if grads_path:
        np.savez(grads_path, **{f"g{i:04d}": a for i, a in enumerate(arrays) if a is not None})
    del loss, grads, arrays

    def run_step():
        step(*inputs)
        measure.sync_devices()

    for _ in range(warmup):
        run_step()
    # Memory first, before anything else is built in this process.
    tf.config.experimental.reset_memory_stats(device)
    out["resting_bytes"] = tf.config.experimental.get_memory_info(device)["current"]
    peak, _ = measure.peak_memory_bytes(
        lambda: measure.time_each_call(run_step, repeats=memory_steps, warmup=0), device)
    out.update(peak_bytes=peak, memory_device=device)

    if not paired or strategy == BASELINE:
        out["step_s"] = measure.time_calls(run_step, repeats=steps, warmup=0)
        return out
    # Time side by side with tf.gradients on the same weights and data, alternating.
    base_step = model.make_step(lambda ys, xs: tf.gradients(ys, xs), jit_compile=jit)

    def run_base():
        base_step(*inputs)
        measure.sync_devices()

    try:
        out["step_s"], out["paired_base_step_s"], out["paired_ratio"] = measure.time_paired(
            run_step, run_base, repeats=steps, warmup=1)
    except tf.errors.ResourceExhaustedError:
        out["message"] = "tf.gradients does not fit beside it under the limit: timed alone"
        out["step_s"] = measure.time_calls(run_step, repeats=steps, warmup=0)
    return out


# ----------------------------------------------------------------------------- parent side

def _child_env(memory_limit_mb, keep_onednn=False):
    pythonpath = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    env = dict(measure.memory_limit_env(memory_limit_mb), PYTHONPATH=pythonpath)
    if memory_limit_mb and not keep_onednn:
        # oneDNN's CPU kernels crash (SIGSEGV) when the capped allocator refuses them;
        # TensorFlow's own kernels raise ResourceExhaustedError, which is reported as OOM.
        env["TF_ENABLE_ONEDNN_OPTS"] = "0"
    return env


def run_one(model, depth, batch, strategy, steps, warmup, seed, memory_limit_mb, grads_path,
            model_options=None, timeout=900, paired=True, grappler=True, jit=False,
            offload=False, fit_probe=False, memory_steps=MEMORY_STEPS):
    """Runs measure_config in its own process; a crash or kill becomes a result row too.

    fit_probe=True: a probe of `fitting_cap` (the cap reserved as one region, the kernels
    of the uncapped run kept: a crash under the cap counts as out of memory)."""
    started = time.perf_counter()
    env = _child_env(memory_limit_mb, keep_onednn=fit_probe)
    dump = tempfile.TemporaryDirectory(prefix="memsave-xla-") if jit else None
    if dump:
        env.update(measure.xla_dump_env(dump.name))
    try:
        result = measure.run_isolated(
            CHILD_TARGET, timeout=timeout, env=env, model=model,
            depth=depth, batch=batch, strategy=strategy, steps=steps, warmup=warmup, seed=seed,
            grads_path=grads_path, memory_limit_mb=memory_limit_mb, model_options=model_options,
            paired=paired, grappler=grappler, jit=jit, xla_dump=dump and dump.name,
            offload=offload, one_region=fit_probe, memory_steps=memory_steps)
    except measure.IsolatedRunError as error:
        if measure.is_oom_failure(error):
            status = "OOM"
            message = f"child died out of memory (exit {error.returncode})"
        elif memory_limit_mb and error.returncode is not None and error.returncode < 0:
            status = "OOM"
            message = (f"child crashed (signal {-error.returncode}) under the {memory_limit_mb} MiB "
                       "limit: counted as out of memory")
        else:
            status = "failed"
            message = _error_line(error.stderr) or str(error).splitlines()[0]
        result = {"model": model, "strategy": strategy, "status": status, "message": message}
    if dump:
        dump.cleanup()
    result["wall_s"] = time.perf_counter() - started
    result.setdefault("depth", depth)
    return result


def fitting_cap(probe, peak_mb, lower_mb=None):
    """The smallest cap, within FIT_TOLERANCE, under which `probe(cap_mb)` runs.

    Args:
      probe: cap_mb -> whether the step ran under that cap (a fresh process each).
      peak_mb: the step's uncapped peak (it runs under that, or a little more).
      lower_mb: a size the step cannot run below (XLA's buffer assignment: its one
        temporary buffer and its outputs, beside the resident weights), tried first at
        FIT_TOLERANCE above it; without one the search starts 15% below the peak and
        steps down by 15% while the step still runs there.
    Returns:
      The cap in MiB, or None when the step did not run even at twice its peak.
    """
    high = None  # the smallest cap seen to run
    if lower_mb:
        low = math.ceil(lower_mb * FIT_TOLERANCE)
        if probe(low):
            return low
    else:
        low = max(1, math.floor(peak_mb * 0.85))
        while probe(low):
            high = low
            if low == 1:
                return low
            low = max(1, math.floor(low * 0.85))
    if high is None:
        high = math.ceil(peak_mb)
        while not probe(high):
            if high > 2 * peak_mb:
                return None
            high = math.ceil(high * 1.25)
    while high > low * FIT_TOLERANCE and high - low > 1:
        middle = math.ceil(math.sqrt(low * high))
        if probe(middle):
            high = middle
        else:
            low = middle
    return high


def _fit(model, depth, batch, strategy, result, seed, model_options, timeout, jit, offload):
    """fitting_cap for one measured configuration (a few steps per probe, none paired)."""
    def probe(cap_mb):
        probed = run_one(model, depth, batch, strategy, steps=1, warmup=0, seed=seed,
                         memory_limit_mb=cap_mb, grads_path=None, model_options=model_options,
                         timeout=timeout, paired=False, jit=jit, offload=offload,
                         fit_probe=True)
        logger.info("  %s under a cap of %d MiB: %s", strategy, cap_mb, probed.get("status"))
        return probed.get("status") == "ok"

    lower = result.get("xla_buffer_bytes")
    return fitting_cap(probe, result["peak_bytes"] / 2**20, lower and lower / 2**20)


# Gradients below this fraction of the largest one count as numerically zero: e.g. a conv
# bias followed by batch norm has a true gradient of 0, and float32 leaves noise there that,
# summed in another order, differs by up to ~1e-6 of the largest gradient (Keras ResNet50:
# 8e-3 of 1e-4 of it; more in bfloat16). The same 1% as the tests' assert_same_gradients.
NEGLIGIBLE = 1e-2


def _max_relative_error(path, reference_path):
    """max over variables of max|g - g_ref| / max|g_ref| (inf if the sets differ).

    Each variable's scale is its own max|g_tf|, but at least NEGLIGIBLE times the
    largest gradient of any variable (so numerically-zero gradients, e.g. of a conv
    bias followed by batch norm, do not turn float noise into a huge ratio).
    """
    import numpy as np

    with np.load(path) as grads, np.load(reference_path) as reference:
        if set(grads.files) != set(reference.files):
            return math.inf
        pairs = [(reference[key], grads[key]) for key in reference.files]
    if any(ref.shape != got.shape for ref, got in pairs):
        return math.inf
    largest = max((float(np.max(np.abs(ref))) for ref, _ in pairs if ref.size), default=0.0)
    worst = 0.0
    for ref, got in pairs:
        if not ref.size:
            continue
        scale = max(float(np.max(np.abs(ref))), NEGLIGIBLE * largest)
        diff = float(np.max(np.abs(got.astype(np.float64) - ref)))
        worst = max(worst, diff / scale if scale > 0 else diff)
    return worst


def default_strategies(model):
    """What a run without --strategies compares: the README's table's columns ('memory',
    budget(0.5)) and 'speed'; 'collection' (on MARKING_MODELS) when asked for."""
    return [BASELINE, "memory", "budget:0.5", "speed"]


def compare(model="cnn", depth=None, batch=None, strategies=None, steps=5, warmup=2, seed=0,
            memory_limit_mb=None, model_options=None, timeout=900, baseline=True, paired=True,
            grappler=True, jit=False, offload=False, fit=False, memory_steps=MEMORY_STEPS):
    """Measures every strategy (tf.gradients first) in its own process; returns table rows.

    baseline=False leaves tf.gradients out (no peak ratios or errors then).
    paired=True times each memsave strategy side by side with tf.gradients in its
    process (see measure_config); the time ratio is then the paired one. jit=True
    compiles every step with XLA (tf.function(jit_compile=True)); offload=True
    passes offload=True to every memsave strategy; fit=True also finds, for each, the
    smallest cap it runs under (`fitting_cap`; several processes of one step each).
    """
    strategies = [s for s in (strategies or default_strategies(model)) if s != BASELINE]
    if baseline:
        strategies.insert(0, BASELINE)
    results = {}
    with tempfile.TemporaryDirectory(prefix="memsave-bench-") as scratch:
        paths = {s: os.path.join(scratch, f"grads_{i}.npz") for i, s in enumerate(strategies)}
        for done, strategy in enumerate(strategies, 1):
            result = run_one(model, depth, batch, strategy, steps, warmup, seed, memory_limit_mb,
                             paths[strategy], model_options, timeout, paired, grappler, jit,
                             offload, memory_steps=memory_steps)
            _log_progress(done, len(strategies), model, depth, result)
            if fit and result.get("status") == "ok":
                result["fits_mb"] = _fit(model, depth, batch, strategy, result, seed,
                                         model_options, timeout, jit, offload)
            results[strategy] = result
        rows = _rows(results, strategies, paths, offload)
    return rows


def _log_progress(done, total, model, depth, result):
    where = f"{model}" + (f" depth {depth}" if depth else "")
    if result.get("status") == "ok":
        logger.info("[%d/%d] %s %s: peak %.1f MiB, step %.1f ms, build %.2f s (%.0f s)", done,
                    total, where, result["strategy"], result["peak_bytes"] / 2**20,
                    result["step_s"] * 1e3, result["grad_build_s"], result["wall_s"])
    else:
        logger.info("[%d/%d] %s %s: %s %s (%.0f s)", done, total, where, result["strategy"],
                    result["status"], result.get("message", ""), result["wall_s"])


def _offload_note(result):
    if not result.get("offload_moved_bytes"):
        return ("offload: nothing moved: no accelerator here (the device and the host share one "
                "memory), so no saving can be measured; run on a GPU machine")
    return (f"offload: {result.get('offloaded', 0)} checkpoints, "
            f"{result['offload_moved_bytes'] / 2**20:.1f} MiB moved per step (out and back)")


def _range_error(measured, least, most):
    """How far a predicted range misses the measured peak: 0 within it, else the nearer
    end's error (positive: predicted above it)."""
    if measured < least:
        return least / measured - 1
    return most / measured - 1 if measured > most else 0.0


def _rows(results, strategies, paths, offload_requested=False):
    base = results.get(BASELINE, {})
    base_ok = base.get("status") == "ok"
    rows = []
    for strategy in strategies:
        result = results[strategy]
        ok = result.get("status") == "ok"
        row = {field: None for field in CSV_FIELDS}
        row.update({key: result.get(key) for key in CSV_FIELDS if key in result})
        row["strategy"] = strategy
        row["description"] = result.get("description")
        row["report"] = result.get("report")
        if result.get("predicted_peak_bytes"):
            # (A calibrated budget's prediction is the one scaled to the measured step.)
            row["predicted_mb"] = (result.get("calibrated_peak_bytes")
                                   or result["predicted_peak_bytes"]) / 2**20
        if ok:
            row["peak_mb"] = result["peak_bytes"] / 2**20
            if row["predicted_mb"]:
                row["predicted_error"] = row["predicted_mb"] / row["peak_mb"] - 1
            if result.get("predicted_peak_range") and not result.get("calibrated_peak_bytes"):
                least, most = (end / 2**20 for end in result["predicted_peak_range"])
                row["predicted_range"] = f"{least:.1f}-{most:.1f}"
                row["range_error"] = _range_error(row["peak_mb"], least, most)
            row["resting_mb"] = result["resting_bytes"] / 2**20
            row["step_ms"] = result["step_s"] * 1e3
            if result.get("paired_ratio") is not None:
                row["time_ratio"] = result["paired_ratio"]
                row["paired_base_step_ms"] = result["paired_base_step_s"] * 1e3
            elif strategy == BASELINE:
                row["time_ratio"] = 1.0
            if base_ok:
                row["peak_ratio"] = result["peak_bytes"] / base["peak_bytes"]
                if row["fits_mb"] and base.get("fits_mb"):
                    row["fits_ratio"] = row["fits_mb"] / base["fits_mb"]
                row["time_ratio_separate"] = result["step_s"] / base["step_s"]
                if row["time_ratio"] is None:
                    row["time_ratio"] = row["time_ratio_separate"]
                if os.path.exists(paths[strategy]) and os.path.exists(paths[BASELINE]):
                    row["max_rel_err"] = _max_relative_error(paths[strategy], paths[BASELINE])
                if result.get("weights_checksum") != base.get("weights_checksum"):
                    row["message"] = "weights differ from tf.gradients's process: error not comparable"
                elif result.get("grad_kinds") != base.get("grad_kinds"):
                    row["message"] = (f"gradient kinds differ from tf.gradients's "
                                      f"({_kind_counts(result)} vs {_kind_counts(base)})")
        if ok and offload_requested and strategy != BASELINE:
            row["message"] = "; ".join(filter(None, [row["message"], _offload_note(result)]))
        if result.get("hlo_ops"):
            row["hlo_ops"] = result["hlo_ops"]
            counts = ", ".join(f"{n} {kind}" for kind, n in sorted(result["hlo_ops"].items()))
            xla = f"optimized HLO: {counts}"
            if result.get("xla_buffer_bytes"):
                row["xla_buffer_mb"] = result["xla_buffer_bytes"] / 2**20
                xla += f"; XLA buffers {row['xla_buffer_mb']:.1f} MiB"
                base_buffers = base.get("xla_buffer_bytes")
                if base_buffers and strategy != BASELINE:
                    xla += f" ({result['xla_buffer_bytes'] / base_buffers:.2f}x)"
            row["message"] = "; ".join(filter(None, [row["message"], xla]))
        rows.append(row)
    return rows


def _kind_counts(result):
    kinds = result.get("grad_kinds") or []
    return ", ".join(f"{kinds.count(k)} {k}" for k in ("dense", "sparse", "none") if k in kinds)


# ----------------------------------------------------------------------------- output

def _fmt(value, spec):
    if value is None:
        return "-"
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    return format(value, spec)


def _columns(rows):
    """The table's columns: FIT_COLUMNS too where a row was fitted (--fit)."""
    return TABLE_COLUMNS + (FIT_COLUMNS if any(row.get("fits_mb") for row in rows) else ())


def _cells(row, columns=TABLE_COLUMNS):
    if row["status"] != "ok":
        return [row["strategy"], row["status"] or "failed"] + ["-"] * (len(columns) - 2)
    cells = [row["strategy"], _fmt(row["peak_mb"], ".1f"), _fmt(row["peak_ratio"], ".2f"),
             _fmt(row["predicted_mb"], ".1f"), _fmt(row["predicted_error"], "+.0%"),
             _fmt(row["step_ms"], ".1f"), _fmt(row["time_ratio"], ".2f"),
             _fmt(row["predicted_time_ratio"], ".2f"), _fmt(row["max_rel_err"], ".1e"),
             _fmt(row["grad_build_s"], ".2f"), _fmt(row["checkpoints"], "d")]
    if len(columns) > len(TABLE_COLUMNS):
        cells += [_fmt(row.get("fits_mb"), "d"), _fmt(row.get("fits_ratio"), ".2f")]
    return cells


def format_table(rows):
    """The comparison as aligned text (notes for failed or odd rows below it)."""
    columns = _columns(rows)
    lines = _aligned([list(columns)] + [_cells(row, columns) for row in rows])
    lines += _notes(rows)
    return "\n".join(lines)


def repeated_rows(runs):
    """Per strategy (in the first run's order), the median and the (lowest, highest) of
    its peak, peak ratio and time ratio over `runs` (a list of compare()'s rows), from
    the runs where it measured.

    Returns:
      [{"strategy", "runs": runs where it measured, "<field>": (median, low, high, n)}]:
      n, the runs the field has a value in (a ratio has none where tf.gradients failed);
      the field is None where no run has one.
    """
    fields = ("peak_mb", "peak_ratio", "time_ratio")
    summary = []
    for strategy in [row["strategy"] for row in runs[0]]:
        rows = [row for run in runs for row in run
                if row["strategy"] == strategy and row.get("peak_mb") is not None]
        entry = {"strategy": strategy, "runs": len(rows)}
        for field in fields:
            values = sorted(row[field] for row in rows if row.get(field) is not None)
            entry[field] = ((statistics.median(values), values[0], values[-1], len(values))
                            if values else None)
        summary.append(entry)
    return summary


def format_repeated(summary):
    """repeated_rows' summary as aligned text: median [lowest-highest] per column, with
    (n=K) where a column has fewer runs than the strategy measured in."""
    def cell(entry, field, spec):
        if entry[field] is None:
            return "-"
        middle, low, high, count = entry[field]
        text = f"{middle:{spec}} [{low:{spec}}-{high:{spec}}]"
        return text + (f" (n={count})" if count != entry["runs"] else "")
    header = ("strategy", "runs", "peak MiB", "x tf", "time x tf")
    lines = [header] + [(entry["strategy"], str(entry["runs"]), cell(entry, "peak_mb", ".1f"),
                         cell(entry, "peak_ratio", ".2f"), cell(entry, "time_ratio", ".2f"))
                        for entry in summary]
    return "\n".join(_aligned(lines) + ["(median [lowest-highest] over the runs)"])


def _aligned(lines):
    """Rows of cells as text lines: the first column left-aligned, the others right,
    a rule under the header."""
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    text = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in
                      enumerate(zip(line, widths))) for line in lines]
    text.insert(1, "  ".join("-" * w for w in widths))
    return text


def format_markdown(rows, title=None):
    """The comparison as a Markdown table."""
    lines = [f"{title}\n"] if title else []
    columns = _columns(rows)
    lines.append("| " + " | ".join(columns) + " |")
    lines.append("|" + "|".join("---" if i == 0 else "---:" for i in range(len(columns))) + "|")
    lines += ["| " + " | ".join(_cells(row, columns)) + " |" for row in rows]
    notes = _notes(rows)
    if notes:
        lines.append("")
        lines += [f"- {note.strip()}" for note in notes]
    return "\n".join(lines) + "\n"


def _notes(rows):
    return [f"  {row['strategy']}: {row['message']}" for row in rows if row.get("message")]


def write_csv(rows, path, fields=CSV_FIELDS):
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def _title(rows, args_line):
    first = next((row for row in rows if row.get("description")), rows[0])
    device = next((row["device"] for row in rows if row.get("device")), "unknown device")
    return f"{first.get('description') or first['model']}; {device}; `{args_line}`"


# ----------------------------------------------------------------------------- predictions

# The model families whose peaks the memory model should predict (issue 29): label,
# model, depth, batch, model options (None: the model's default).
PREDICT_FAMILIES = (
    ("default CNN", "cnn", None, None, {}),
    ("MLP", "mlp", None, None, {}),
    ("nested tf.function calls", "calls", None, None, {}),
    ("transformer (own ops)", "transformer", None, None, {}),
    ("Keras ResNet50 96 px", "keras", None, 16, {"app": "ResNet50", "image_size": 96}),
    ("Keras ResNet50 96 px, mixed_bfloat16", "keras", None, 16,
     {"app": "ResNet50", "image_size": 96, "mixed_precision": "bfloat16"}),
    ("Keras ConvNeXtTiny 64 px", "keras", None, 16, {"app": "ConvNeXtTiny", "image_size": 64}),
    ("ViT (Keras layers)", "vit", None, None, {}),
    ("GPT (Keras layers)", "gpt", None, None, {}),
    ("2 x Keras LSTM(256)", "lstm", None, None, {}),
    # Issue 29's rows: an 8-layer transformer encoder from Keras layers (d 256, 8 heads,
    # 256 tokens: the ViT's patches of a 128 px image, batch 16), and a U-Net.
    ("Keras-layer transformer (d 256, 8 heads, 256 tokens, batch 16)", "vit", 8, 16,
     {"image_size": 128, "d_model": 256, "heads": 8}),
    ("Keras U-Net 128 px", "unet", None, None, {}),
)
PREDICT_COLUMNS = ("model", "strategy", "measured MiB", "predicted MiB", "error",
                   "range MiB", "range error")


def predict_table(families=PREDICT_FAMILIES, strategies=(BASELINE, "memory"), steps=1,
                  warmup=1, seed=0, timeout=900, memory_steps=PREDICT_MEMORY_STEPS):
    """Measured against predicted peaks for every family and strategy (each configuration
    in its own process, as compare() measures, the peak the highest of `memory_steps`
    steps); one row per (family, strategy)."""
    rows = []
    for label, model, depth, batch, options in families:
        measured = compare(model, depth, batch, [s for s in strategies if s != BASELINE],
                           steps, warmup, seed, model_options=dict(options), timeout=timeout,
                           baseline=BASELINE in strategies, paired=False,
                           memory_steps=memory_steps)
        for row in measured:
            rows.append(dict(row, family=label))
    return rows


def predict_families(wanted=None):
    """The PREDICT_FAMILIES whose label contains one of `wanted` (case aside), all of
    them where `wanted` is empty; a name no label contains raises ValueError."""
    if not wanted:
        return PREDICT_FAMILIES
    unknown = [w for w in wanted if not any(w.lower() in f[0].lower() for f in PREDICT_FAMILIES)]
    if unknown:
        raise ValueError(f"no model family's label contains {unknown}; the families are "
                         f"{[f[0] for f in PREDICT_FAMILIES]}")
    return tuple(f for f in PREDICT_FAMILIES if any(w.lower() in f[0].lower() for w in wanted))


def format_predict_table(rows, markdown=False):
    """The predictions as text (or Markdown): measured and predicted peak and their error."""
    cells = [[row["family"], row["strategy"]] + (
        [_fmt(row["peak_mb"], ".1f"), _fmt(row["predicted_mb"], ".1f"),
         _fmt(row["predicted_error"], "+.0%"), row.get("predicted_range") or "-",
         _fmt(row.get("range_error"), "+.0%")] if row["status"] == "ok"
        else [row["status"] or "failed", "-", "-", "-", "-"]) for row in rows]
    if markdown:
        lines = ["| " + " | ".join(PREDICT_COLUMNS) + " |",
                 "|---|---|---:|---:|---:|---:|---:|"]
        return "\n".join(lines + ["| " + " | ".join(line) + " |" for line in cells]) + "\n"
    table = [list(PREDICT_COLUMNS)] + cells
    widths = [max(len(line[i]) for line in table) for i in range(len(PREDICT_COLUMNS))]
    lines = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in
                       enumerate(zip(line, widths))) for line in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# ----------------------------------------------------------------------------- sweep

def sweep(model="cnn", depths=None, strategies=None, batch=None, steps=3, warmup=1, seed=0,
          memory_limit_mb=None, model_options=None, timeout=900, paired=True):
    """compare() at every depth; a strategy that ran out of memory is not retried deeper."""
    depths = list(depths or DEFAULT_SWEEP_DEPTHS[model])
    strategies = list(strategies or default_strategies(model))
    if BASELINE in strategies:
        strategies.remove(BASELINE)
    strategies.insert(0, BASELINE)
    out_of_memory_at = {}
    all_rows = []
    for depth in depths:
        to_run = [s for s in strategies if s not in out_of_memory_at]
        rows = []
        if to_run:
            rows = compare(model, depth, batch, to_run, steps, warmup, seed, memory_limit_mb,
                           model_options, timeout, baseline=BASELINE in to_run, paired=paired)
        for strategy in strategies:
            if strategy in out_of_memory_at:
                row = {field: None for field in CSV_FIELDS}
                row.update(model=model, depth=depth, strategy=strategy, status="OOM",
                           message=f"not run: out of memory already at depth "
                                   f"{out_of_memory_at[strategy]}")
                rows.append(row)
        for row in rows:
            row["depth"] = depth
            row["model"] = model
            if row["status"] == "OOM":
                out_of_memory_at.setdefault(row["strategy"], depth)
        rows.sort(key=lambda r: strategies.index(r["strategy"]))
        all_rows += rows
    return all_rows


def _pyplot():
    """matplotlib.pyplot (headless), or None with a warning when it is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed, so no plot was drawn "
                       "(pip install matplotlib, or memsave[bench]); the CSV has the numbers")
        return None
    return plt


def _save_figure(plt, figure, png_path, title, width, fontsize):
    """Titles `figure` with `title` wrapped at `width` characters and writes it to png_path."""
    if title:
        import textwrap
        figure.suptitle("\n".join(textwrap.wrap(title, width)), fontsize=fontsize)
    figure.tight_layout()
    Path(png_path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(png_path, dpi=110)
    plt.close(figure)


def plot_sweep(rows, png_path, memory_limit_mb=None, title=None):
    """Draws memory vs depth and step time vs depth; returns False if matplotlib is missing."""
    plt = _pyplot()
    if plt is None:
        return False
    strategies = list(dict.fromkeys(row["strategy"] for row in rows))
    figure, (memory_axes, time_axes) = plt.subplots(1, 2, figsize=(11, 4.2))
    oom_label_done = False
    for index, strategy in enumerate(strategies):
        mine = [r for r in rows if r["strategy"] == strategy]
        ok = [r for r in mine if r["status"] == "ok"]
        line, = memory_axes.plot([r["depth"] for r in ok], [r["peak_mb"] for r in ok], "o-",
                                 label=strategy)
        time_axes.plot([r["depth"] for r in ok], [r["step_ms"] for r in ok], "o-",
                       color=line.get_color(), label=strategy)
        ooms = [r["depth"] for r in mine if r["status"] == "OOM"]
        if ooms:
            top = memory_limit_mb or max((r["peak_mb"] for r in rows if r["peak_mb"]), default=1)
            top *= 1 - 0.04 * index  # staggered, so strategies out of memory at one depth all show
            memory_axes.plot(ooms, [top] * len(ooms), "x", color=line.get_color(), ms=10,
                             mew=2, label=None if oom_label_done else "out of memory (x)")
            oom_label_done = True
    if memory_limit_mb:
        memory_axes.axhline(memory_limit_mb, color="grey", ls="--", lw=1)
        memory_axes.text(memory_axes.get_xlim()[0], memory_limit_mb, f" limit {memory_limit_mb} MiB",
                         va="bottom", color="grey", fontsize=8)
    memory_axes.set(xlabel="depth", ylabel="peak memory (MiB)", title="peak memory vs depth")
    time_axes.set(xlabel="depth", ylabel="step time (ms)", title="step time vs depth")
    for axes in (memory_axes, time_axes):
        axes.grid(alpha=0.3)
        axes.legend(fontsize=8)
    _save_figure(plt, figure, png_path, title, width=150, fontsize=8)
    return True


def format_sweep(rows):
    """The sweep as text: one line per depth, peak MiB and step ms per strategy."""
    strategies = list(dict.fromkeys(row["strategy"] for row in rows))
    depths = list(dict.fromkeys(row["depth"] for row in rows))
    header = ["depth"] + [f"{s} MiB / ms" for s in strategies]
    lines = [header]
    for depth in depths:
        line = [str(depth)]
        for strategy in strategies:
            row = next((r for r in rows if r["depth"] == depth and r["strategy"] == strategy),
                       None)
            if row is None:
                line.append("-")
            elif row["status"] == "ok":
                line.append(f"{row['peak_mb']:.1f} / {row['step_ms']:.0f}")
            else:
                line.append(row["status"])
        lines.append(line)
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in lines)


# ----------------------------------------------------------------------------- budget sweep

DEFAULT_BUDGETS = (1.0, 0.8, 0.6, 0.5, 0.4, 0.3, 0.25, 0.2, 0.15)


def budget_sweep(model="cnn", budgets=DEFAULT_BUDGETS, depth=None, batch=None, steps=5,
                 warmup=2, seed=0, model_options=None, timeout=900, paired=True):
    """tf.gradients, the named strategies and memsave.budget(F) for every F, each in its
    own process. Budgets below the smallest feasible one come back as errors
    (memsave says which peak it can reach), so the curve ends where memsave must."""
    strategies = ([s for s in default_strategies(model) if not s.startswith("budget:")]
                  + [f"budget:{b:g}" for b in budgets])
    return compare(model, depth, batch, strategies, steps, warmup, seed, None, model_options,
                   timeout, paired=paired)


def plot_budget_sweep(rows, png_path, title=None):
    """Measured peak against step time: the budget curve and the strategies as points."""
    plt = _pyplot()
    if plt is None:
        return False
    ok = [r for r in rows if r["status"] == "ok" and r["time_ratio"] is not None]
    budgets = [r for r in ok if r["strategy"].startswith("budget:")]
    figure, axes = plt.subplots(figsize=(7.5, 5))
    axes.plot([r["time_ratio"] for r in budgets], [r["peak_mb"] for r in budgets], "o-",
              color="tab:blue", label="memsave.budget(F)")
    for r in budgets:
        axes.annotate(r["strategy"].split(":", 1)[1], (r["time_ratio"], r["peak_mb"]),
                      textcoords="offset points", xytext=(5, 4), fontsize=8, color="tab:blue")
    markers = {BASELINE: ("s", "black"), "speed": ("^", "tab:orange"),
               "memory": ("D", "tab:green"), "collection": ("v", "tab:purple")}
    for r in ok:
        if r["strategy"] in markers:
            marker, color = markers[r["strategy"]]
            axes.plot([r["time_ratio"]], [r["peak_mb"]], marker, color=color, ms=9,
                      label=r["strategy"])
    axes.set(xlabel="step time / tf.gradients' step time (paired)", ylabel="measured peak (MiB)",
             title="peak memory against step time")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    _save_figure(plt, figure, png_path, title, width=110, fontsize=7)
    return True


# ----------------------------------------------------------------------------- main

def _parse_list(text, cast=str):
    return [cast(item.strip()) for item in text.split(",") if item.strip()] if text else None


def draw_picture(args):
    """--picture: the model's step planned (memsave.plan: nothing is added or run) with the
    first memsave strategy named, its report's picture printed and saved."""
    import tensorflow as tf

    import memsave
    from benchmarks.models import build_model
    from memsave import environment

    strategy = next((s for s in _parse_list(args.strategies) or [] if s != BASELINE), "memory")
    if strategy.startswith(BUDGETS):
        checkpoints = budget_of(strategy)
    elif strategy in MEMSAVE_STRATEGIES:
        checkpoints = strategy
    else:
        raise SystemExit(f"--picture draws one of {', '.join(MEMSAVE_STRATEGIES)}, budget:F or "
                         f"time:T, not {strategy!r}")
    options = {k: v for k, v in (("app", args.app), ("image_size", args.image_size),
                                 ("seq_len", args.seq_len)) if v is not None}
    bench = build_model(args.model, depth=args.depth, batch=args.batch, seed=args.seed, **options)
    reports = []

    def planned(*inputs):
        reports.append(memsave.plan(bench.loss(*inputs), bench.variables,
                                    checkpoints=checkpoints))
        return tf.constant(0.0)

    # Planned for the allocator the measured runs have (a CPU's BFC, as measure sets it;
    # the capped one-region device under --memory-limit-mb), so the report's peaks are
    # those the table predicts.
    allocator = (environment.ONE_REGION if args.memory_limit_mb
                 else None if tf.config.list_physical_devices("GPU") else environment.CPU_GROWING)
    with environment.assuming_allocator(allocator):
        tf.function(planned, autograph=False).get_concrete_function(
            *[tf.TensorSpec(x.shape, tf.as_dtype(x.dtype)) for x in bench.inputs])
    report = reports[-1]
    limit = args.memory_limit_mb << 20 if args.memory_limit_mb else None
    print(f"{bench.description}; strategy {strategy}; {measure.device_description()}")
    print(report.summary())
    print(report.picture(limit=limit))
    if args.picture != "-":
        print("saved", report.save_picture(args.picture, limit=limit))
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(
        description="Peak memory, step time, gradient error and build time of tf.gradients "
                    "and memsave's strategies, each configuration in its own process.")
    parser.add_argument("--model", default="cnn", choices=MODELS)
    parser.add_argument("--depth", type=int, default=None,
                        help="residual blocks (cnn), layers (mlp) or encoder blocks "
                             "(transformer); default per model (81, 36, 8)")
    parser.add_argument("--batch", type=int, default=None, help="batch size; default per model")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before timing")
    parser.add_argument("--jit", action="store_true",
                        help="compile every step with XLA (tf.function(jit_compile=True)); the "
                             "notes give the dot/convolution ops of each optimized HLO")
    parser.add_argument("--fit", action="store_true",
                        help="also find, for each strategy, the smallest cap (within 3%%) its "
                             "step runs under, the cap reserved as one region as a GPU's "
                             "allocator holds it: what the step needs (columns 'fits MiB')")
    parser.add_argument("--offload", action="store_true",
                        help="memsave strategies keep their checkpoints in host memory "
                             "(offload=True); the notes give what moved per step")
    parser.add_argument("--disable-grappler", action="store_true",
                        help="turn TensorFlow's graph optimizer off in every process: a check "
                             "that gradient differences are float rounding from differently "
                             "optimized graphs (timings then are not representative)")
    parser.add_argument("--no-paired", action="store_true",
                        help="time each configuration alone in its process (ratios across "
                             "processes) instead of alternating with tf.gradients in the same one")
    parser.add_argument("--strategies", default=None,
                        help="comma-separated, from tf.gradients, speed, memory, collection, "
                             "budget:F (memsave.budget(F), F a fraction or e.g. 200MiB), "
                             "time:T (memsave.budget(time=T): the lowest peak within T times "
                             "tf.gradients' predicted step time), "
                             "calibrated-budget:F (the same, with the step measured first by "
                             "memsave.calibrate_memory), every:K "
                             "(explicit list: every K-th block output), tape:S (the step recorded "
                             "on memsave.GradientTape(checkpoints=S)), patched-tape:S (on "
                             "tf.GradientTape under memsave.patch(checkpoints=S)), remat:MODE "
                             "(--model keras built in keras.RematScope(mode=MODE): full, "
                             "activations, larger_than); a memsave strategy may end in "
                             "+chunk:K (its loops recomputed in chunks of K iterations, 1: "
                             "none; memsave.recompute_loops(chunk=K)); default: "
                             "tf.gradients,memory,budget:0.5,speed")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--app", default=None,
                        help="keras.applications model for --model keras (default ResNet50)")
    parser.add_argument("--mixed-precision", choices=MIXED_PRECISION, default=None,
                        help="build a Keras model under Keras' mixed_float16 / mixed_bfloat16 "
                             "dtype policy")
    parser.add_argument("--image-size", type=int, default=None,
                        help="input size for --model keras (default 64) or cnn (default 32)")
    parser.add_argument("--seq-len", type=int, default=None,
                        help="sequence length for --model lstm (default 100)")
    parser.add_argument("--memory-limit-mb", type=int, default=None,
                        help="cap the measured device's allocator (GPU: a virtual device; CPU: "
                             "the BFC allocator); running out is reported as OOM")
    parser.add_argument("--csv", default=None, help="write the rows to this CSV file")
    parser.add_argument("--markdown", default=None, help="write the table as Markdown here")
    parser.add_argument("--sweep", action="store_true", help="peak memory and step time vs depth")
    parser.add_argument("--budget-sweep", action="store_true",
                        help="memsave.budget(F) for F from 1.0 down to the smallest feasible, "
                             "with tf.gradients and the named strategies; plots peak vs time")
    parser.add_argument("--budgets", default=None,
                        help="comma-separated budget fractions for --budget-sweep")
    parser.add_argument("--depths", default=None, help="comma-separated depths for --sweep")
    parser.add_argument("--png", default=None,
                        help="plot for --sweep (default benchmarks/results/sweep_<model>.png)")
    parser.add_argument("--predict-table", action="store_true",
                        help="the memory model's predicted peak against the measured one for "
                             "every model family (PREDICT_FAMILIES) and each of --strategies "
                             "(default tf.gradients,memory); no timings; the peak is the "
                             "highest of --memory-steps steps")
    parser.add_argument("--memory-steps", type=int, default=None,
                        help=f"steps over which the peak is taken (default {MEMORY_STEPS}, "
                             f"{PREDICT_MEMORY_STEPS} with --predict-table)")
    parser.add_argument("--families", default=None,
                        help="with --predict-table: comma-separated parts of the family labels "
                             "to measure (e.g. 'cnn,lstm,resnet50'; default every family)")
    parser.add_argument("--build-time", action="store_true",
                        help="time memsave.gradients's rewrite vs tf.gradients on generated "
                             "graphs of ~1k, ~5k, ~20k ops (in this process)")
    parser.add_argument("--sizes", default=None, help="op counts for --build-time")
    parser.add_argument("--picture", nargs="?", const="-", default=None, metavar="PNG",
                        help="draw the step's live memory over time, memsave's plan (the first "
                             "memsave strategy of --strategies, default 'memory') against "
                             "tf.gradients', as the memory model predicts it (nothing runs): "
                             "as text, and as a PNG where a path is given (matplotlib)")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per configuration")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run the comparison this many times; then each ratio's median "
                             "and range over the runs")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    args = parser.parse_args(argv)
    _check_repeat(parser, args)

    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO,
                        format="%(message)s", stream=sys.stderr)
    command = "python benchmarks/compare.py " + " ".join(sys.argv[1:] if argv is None else argv)

    if args.picture:
        return draw_picture(args)

    if args.predict_table:
        strategies = _parse_list(args.strategies) or [BASELINE, "memory"]
        rows = predict_table(families=predict_families(_parse_list(args.families)),
                             strategies=strategies, seed=args.seed, timeout=args.timeout,
                             memory_steps=args.memory_steps or PREDICT_MEMORY_STEPS)
        device = next((row["device"] for row in rows if row.get("device")), "unknown device")
        title = f"Predicted against measured peaks; {device}; `{command}`"
        print(title)
        print(format_predict_table(rows))
        if args.csv:
            write_csv(rows, args.csv, ("family",) + CSV_FIELDS)
        if args.markdown:
            Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
            Path(args.markdown).write_text(f"{title}\n\n{format_predict_table(rows, True)}",
                                           encoding="utf-8")
        return 0

    if args.build_time:
        from benchmarks import bench_rewrite_time
        sizes = _parse_list(args.sizes, int) or list(bench_rewrite_time.SIZES)
        strategies = [s for s in (_parse_list(args.strategies) or bench_rewrite_time.STRATEGIES)
                      if s != BASELINE]
        rows = bench_rewrite_time.build_time_rows(sizes, strategies, timeout=args.timeout)
        text = bench_rewrite_time.format_rows(rows, strategies)
        print(text)
        if args.csv:
            bench_rewrite_time.write_csv(rows, args.csv)
        if args.markdown:
            Path(args.markdown).write_text(f"`{command}`\n\n```\n{text}\n```\n", encoding="utf-8")
        return 0

    model_options = {}
    if args.app:
        model_options["app"] = args.app
    if args.image_size:
        model_options["image_size"] = args.image_size
    if args.seq_len:
        if args.model != "lstm":
            parser.error("--seq-len applies to --model lstm")
        model_options["seq_len"] = args.seq_len
    if args.mixed_precision:
        if args.model not in KERAS_MODELS:
            parser.error(f"--mixed-precision applies to Keras models ({', '.join(KERAS_MODELS)})")
        model_options["mixed_precision"] = args.mixed_precision
    strategies = _parse_list(args.strategies)

    if args.budget_sweep:
        budgets = _parse_list(args.budgets, float) or DEFAULT_BUDGETS
        rows = budget_sweep(args.model, budgets, args.depth, args.batch, args.steps, args.warmup,
                            args.seed, model_options, args.timeout, paired=not args.no_paired)
        title = _title(rows, command)
        print(title)
        print(format_table(rows))
        csv_path = args.csv or f"benchmarks/results/budget_{args.model}.csv"
        write_csv(rows, csv_path)
        png_path = args.png or f"benchmarks/results/budget_{args.model}.png"
        drew = plot_budget_sweep(rows, png_path, title)
        print(f"\nwrote {csv_path}" + (f" and {png_path}" if drew else ""))
        if args.markdown:
            Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
            Path(args.markdown).write_text(format_markdown(rows, title), encoding="utf-8")
        return 0

    if args.sweep:
        depths = _parse_list(args.depths, int)
        rows = sweep(args.model, depths, strategies, args.batch, args.steps, args.warmup,
                     args.seed, args.memory_limit_mb, model_options, args.timeout,
                     paired=not args.no_paired)
        print(format_sweep(rows))
        csv_path = args.csv or f"benchmarks/results/sweep_{args.model}.csv"
        write_csv(rows, csv_path)
        png_path = args.png or f"benchmarks/results/sweep_{args.model}.png"
        device = next((row["device"] for row in rows if row.get("device")), "unknown device")
        title = f"{args.model} model, depth swept; {device}; {command}"
        drew = plot_sweep(rows, png_path, args.memory_limit_mb, title)
        print(f"\nwrote {csv_path}" + (f" and {png_path}" if drew else ""))
        if args.markdown:
            Path(args.markdown).write_text(f"{title}\n\n```\n{format_sweep(rows)}\n```\n",
                                           encoding="utf-8")
        return 0

    runs = []
    for run in range(args.repeat):
        rows = compare(args.model, args.depth, args.batch, strategies, args.steps, args.warmup,
                       args.seed, args.memory_limit_mb, model_options, args.timeout,
                       paired=not args.no_paired, grappler=not args.disable_grappler,
                       jit=args.jit, offload=args.offload, fit=args.fit,
                       memory_steps=args.memory_steps or MEMORY_STEPS)
        runs.append(rows)
        title = _title(rows, command)
        print(title + (f" (run {run + 1} of {args.repeat})" if args.repeat > 1 else ""))
        print(format_table(rows))
    repeated = ""
    if args.repeat > 1:
        repeated = f"{args.repeat} runs:\n{format_repeated(repeated_rows(runs))}"
        print(f"\n{repeated}")
    for row in rows:
        if row.get("report"):
            logger.info("%s: %s", row["strategy"], row["report"])
    if args.csv:  # (every run's rows, numbered)
        write_csv([dict(row, run=number) for number, run in enumerate(runs, 1) for row in run],
                  args.csv, ("run",) + CSV_FIELDS)
    if args.markdown:  # (the last run's table, and the runs' medians and ranges)
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(
            format_markdown(rows, title) + (f"\n```\n{repeated}\n```\n" if repeated else ""),
            encoding="utf-8")
    return 0


# The modes of main that run something else than the side-by-side comparison.
_OTHER_MODES = ("picture", "predict_table", "build_time", "budget_sweep", "sweep")


def _check_repeat(parser, args):
    """--repeat: a count of 1 or more, for the side-by-side comparison only."""
    if args.repeat < 1:
        parser.error(f"--repeat is {args.repeat}; pass how many times to run the comparison, 1 "
                     "or more")
    other = [mode for mode in _OTHER_MODES if getattr(args, mode)]
    if args.repeat != 1 and other:
        parser.error(f"--repeat applies to the side-by-side comparison, not to "
                     f"--{other[0].replace('_', '-')}; leave one of them out")


if __name__ == "__main__":
    sys.exit(main())
