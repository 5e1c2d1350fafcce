"""What batch fits? memsave.keras.max_batch_size's answers, confirmed by capped runs.

    python benchmarks/capacity.py                          # MLP, ResNet50 (64 px), GPT
    python benchmarks/capacity.py --models gpt --limit 384MiB --optimizer adam

For each model (built from Keras layers, compiled with Adam), one process asks
`memsave.keras.max_batch_size(model, limit)` and prints its table: per batch traced,
memsave's and plain TensorFlow's predicted peaks and the recomputation's predicted cost.
Then each answer is run: the training step `fit` runs (the model's train_step in a
tf.function, two steps of that batch, given as tensors: on a CPU, fit's input pipeline
would hold the dataset and a few batches in the same allocator, where a GPU's are in host
memory) in a process of its own whose CPU allocator is capped at the limit and holds it
as one region, as a GPU holds its memory (TF_CPU_BFC_MEM_LIMIT_IN_MB,
memsave.measure.reserve_one_region): memsave's batch with memsave (memsave.keras.enable)
and plain Keras' batch without, each at the answer (it should run) and at 1.2x the answer
(it should run out of memory).
"""

import argparse
import math
import os
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from memsave import measure  # noqa: E402

# Each model's default limit: answers of tens to thousands of examples, where the batch's
# activations are most of the step (at 512 MiB, ResNet50's weights and Adam's slots were
# 300: 1.2x the batch then needs only a few percent more, within a run's own spread).
DEFAULT_LIMITS = {"mlp": "96MiB", "keras": "1GiB", "gpt": "1GiB", "lstm": "128MiB"}
ANSWER_TARGET = "benchmarks.capacity:answer"
RUN_TARGET = "benchmarks.capacity:capped_step"
OVER = 1.2
UNCAPPED_FACTOR = 4


def _model(name, batch, optimizer="adam"):
    """(compiled keras.Model, x, y) of `batch` examples: a deep tanh MLP, a
    keras.applications ResNet50 at 64 px, benchmarks.models' GPT or LSTM stack."""
    import keras

    if name == "mlp":
        from benchmarks import keras_fit_memory
        net = keras_fit_memory.build_model(24, 256, 10)
        x, y = keras_fit_memory.synthetic_batch(batch, 256, 10)
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    else:
        from benchmarks import models
        options = {"app": "ResNet50"} if name == "keras" else {}
        bench = models.build_model(name, batch=batch, **options)
        net, (x, y) = bench.keras_model, bench.inputs
        # (keras.applications end in a softmax; the others give logits)
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=name != "keras")
    net.compile(optimizer=(keras.optimizers.Adam(1e-3) if optimizer == "adam"
                           else keras.optimizers.SGD(0.01)), loss=loss)
    return net, x, y


def answer(model, limit, optimizer="adam"):
    """In a fresh process: max_batch_size's answer for `model` within `limit`."""
    import memsave

    net, x, y = _model(model, 2, optimizer)
    capacity = memsave.keras.max_batch_size(net, limit, x=x, y=y)
    return {"batch_size": capacity.batch_size, "baseline_batch_size": capacity.baseline_batch_size,
            "limit": capacity.memory_limit, "summary": capacity.summary(),
            "step_time": capacity.at(capacity.batch_size).step_time if capacity.batch_size else None}


def capped_step(model, batch, limit_mb, with_memsave, optimizer="adam"):
    """In a fresh process whose allocator is capped at `limit_mb` (one region): whether
    two training steps of `batch` examples run ({"oom": False, "peak": bytes}) or run
    out of memory ({"oom": True}).

    The step is the one `fit` runs (the model's `train_step`, memsave's where enabled,
    compiled with tf.function), given its batch as tensors in the allocator's memory (as
    the batch a step gets is): `fit`'s input pipeline, which on a CPU holds the dataset
    and a few batches in the same allocator (a GPU's are in host memory), is left out,
    as max_batch_size leaves it out.
    """
    import tensorflow as tf

    import memsave

    measure.reserve_one_region(limit_mb)
    tf.config.experimental.reset_memory_stats("CPU:0")  # (the reservation's peak is not the step's)
    try:
        net, x, y = _model(model, batch, optimizer)
        if with_memsave:
            memsave.keras.enable(net)
        net.optimizer.build(net.trainable_variables)
        step = tf.function(net.train_step)
        # (in the allocator's memory, as a batch from fit's dataset or on a GPU is:
        # tf.constant of an array sometimes keeps its copy outside it)
        data = (measure.device_input(x), measure.device_input(y))
        for _ in range(2):
            step(data)
    except tf.errors.ResourceExhaustedError:
        return {"oom": True}
    return {"oom": False,
            "peak": tf.config.experimental.get_memory_info("CPU:0")["peak"]}


def _capped(model, batch, limit_bytes, with_memsave, optimizer, timeout):
    limit_mb = limit_bytes >> 20
    env = dict(measure.memory_limit_env(limit_mb),
               PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    try:
        return measure.run_isolated(RUN_TARGET, timeout=timeout, env=env, model=model,
                                    batch=batch, limit_mb=limit_mb, with_memsave=with_memsave,
                                    optimizer=optimizer)
    except measure.IsolatedRunError as error:
        if measure.is_oom_failure(error):
            return {"oom": True}
        if not (error.returncode or 0) < 0:
            raise
        return _crashed(model, batch, limit_bytes, with_memsave, optimizer, timeout, error)


def _crashed(model, batch, limit_bytes, with_memsave, optimizer, timeout, error):
    """A capped step killed by a signal: with oneDNN on, a kernel whose allocation fails
    under the cap crashes (SIGSEGV, no message) instead of raising ResourceExhausted
    (AMD EPYC with AVX-512: plain Keras' MLP at 1.2x its answer). Counted as out of
    memory only where the same step, uncapped (a region of UNCAPPED_FACTOR times the
    limit), then holds more than the limit at its peak; raised otherwise."""
    uncapped = _capped(model, batch, UNCAPPED_FACTOR * limit_bytes, with_memsave, optimizer,
                       timeout)
    if uncapped["oom"] or uncapped["peak"] <= limit_bytes:
        raise error
    return {"oom": True, "crashed": -error.returncode, "uncapped_peak": uncapped["peak"]}


def confirm(model, limit=None, optimizer="adam", timeout=900):
    """max_batch_size's answers for `model`, each run under the cap at the answer and at
    OVER times it.

    Returns:
      {"model", "limit", "summary", "rows": [{"who", "batch", "at_answer", "over"}]}
      where at_answer / over are capped_step's results.
    """
    env = {"PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    found = measure.run_isolated(ANSWER_TARGET, timeout=timeout, env=env, model=model,
                                 limit=limit or DEFAULT_LIMITS[model], optimizer=optimizer)
    rows = []
    for who, batch, with_memsave in (("memsave", found["batch_size"], True),
                                     ("plain Keras", found["baseline_batch_size"], False)):
        over = math.ceil(OVER * batch) if batch else 1
        rows.append({"who": who, "batch": batch,
                     "at_answer": (_capped(model, batch, found["limit"], with_memsave, optimizer,
                                           timeout) if batch else None),
                     "over_batch": over,
                     "over": _capped(model, over, found["limit"], with_memsave, optimizer,
                                     timeout)})
    return {"model": model, "limit": found["limit"], "summary": found["summary"],
            "step_time": found["step_time"], "rows": rows}


def _ran(result):
    if result is None:
        return "-"
    if result["oom"] and "crashed" in result:
        return (f"out of memory (signal {result['crashed']} under the cap; "
                f"{result['uncapped_peak'] / 2**20:.1f} MiB uncapped)")
    if result["oom"]:
        return "out of memory"
    return f"ran (peak {result['peak'] / 2**20:.1f} MiB)"


def format_confirmation(confirmation):
    lines = [f"| {confirmation['model']} | who | answer | at the answer | at {OVER}x |",
             "|---|---|---:|---|---|"]
    for row in confirmation["rows"]:
        lines.append(f"| | {row['who']} | {row['batch']} | {_ran(row['at_answer'])} | "
                     f"{row['over_batch']}: {_ran(row['over'])} |")
    return "\n".join(lines)


def confirmed(confirmation):
    """Whether every answer ran and every 1.2x answer ran out of memory."""
    return all((row["at_answer"] is None or not row["at_answer"]["oom"]) and row["over"]["oom"]
               for row in confirmation["rows"])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=sorted(DEFAULT_LIMITS),
                        default=["mlp", "keras", "gpt"])
    parser.add_argument("--limit", help="the memory limit, e.g. 512MiB (default: per model, "
                        + ", ".join(f"{m} {v}" for m, v in DEFAULT_LIMITS.items()) + ")")
    parser.add_argument("--optimizer", choices=["adam", "sgd"], default="adam")
    args = parser.parse_args(argv)
    print(measure.device_description())
    everything = True
    for model in args.models:
        confirmation = confirm(model, args.limit, args.optimizer)
        print(f"\n{confirmation['summary']}\n")
        print(format_confirmation(confirmation))
        everything &= confirmed(confirmation)
    print("\nevery answer ran and every 1.2x answer ran out of memory" if everything
          else "\nNOT CONFIRMED: an answer ran out of memory or 1.2x of one ran")
    return 0 if everything else 1


if __name__ == "__main__":
    sys.exit(main())
