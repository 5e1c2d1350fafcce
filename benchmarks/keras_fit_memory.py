"""Peak memory of one Keras 3 `model.fit` step: plain Keras against memsave.keras and
against plain Keras under `memsave.patch` (its fit's tf.GradientTape computed by memsave).

    python benchmarks/keras_fit_memory.py                      # 24 Dense layers, batch 2048
    python benchmarks/keras_fit_memory.py --depth 48 --width 512 --checkpoints memory speed

Each configuration runs in its own process (`memsave.measure.run_isolated`, BFC
allocator on): build a deep tanh MLP (functional Keras model, seeded), compile
with SGD (jit_compile=False in both, so both run the same executor; --jit: True in
both, so both are compiled by XLA), fit one
epoch of one batch to trace and warm up, then fit one more one-batch epoch while
the allocator records its peak. The losses of both epochs are returned, so the
parent can check that memsave trains exactly like Keras.

Columns: peak MiB (allocator peak during the measured fit step: weights,
optimizer state, data, activations, gradients), x keras (that peak divided by
plain Keras'), losses (the two epochs' losses).
"""

import argparse
import concurrent.futures
import logging
import os
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from memsave import measure  # noqa: E402

logger = logging.getLogger("memsave.benchmarks")

TARGET = "benchmarks.keras_fit_memory:measure_fit_step"
DEFAULTS = {"depth": 24, "width": 256, "batch": 2048, "classes": 10}


def build_model(depth, width, classes, memsave_checkpoints=None, seed=0):
    """A deep tanh MLP, functional; a memsave.keras.MemsaveModel if checkpoints are given.

    Args:
      depth: number of hidden Dense(width, tanh) layers.
      width: units per hidden layer (and input features).
      classes: output classes (softmax-free logits).
      memsave_checkpoints: None for a plain keras.Model, else the memsave strategy.
      seed: weight-initialisation seed (the same in every process).
    Returns:
      An uncompiled Keras model.
    """
    import keras

    keras.utils.set_random_seed(seed)
    inputs = keras.Input((width,))
    h = inputs
    for i in range(depth):
        h = keras.layers.Dense(width, activation="tanh", name=f"dense_{i}")(h)
    outputs = keras.layers.Dense(classes, name="logits")(h)
    if memsave_checkpoints is None:
        return keras.Model(inputs, outputs)
    import memsave
    return memsave.keras.MemsaveModel(inputs, outputs, checkpoints=memsave_checkpoints)


def synthetic_batch(batch, width, classes, seed=1):
    """A seeded batch (features float32, integer labels)."""
    import numpy as np
    rng = np.random.RandomState(seed)
    return (rng.randn(batch, width).astype("float32"),
            rng.randint(0, classes, size=(batch,)).astype("int32"))


def measure_fit_step(checkpoints=None, depth=DEFAULTS["depth"], width=DEFAULTS["width"],
                     batch=DEFAULTS["batch"], classes=DEFAULTS["classes"], jit_compile=False,
                     patched=False):
    """In a fresh process: peak bytes of one `fit` step (one batch, one epoch).

    Args:
      checkpoints: None for plain Keras, else the memsave strategy name.
      patched: a plain keras.Model fitted under memsave.patch(checkpoints=...), not a
        memsave.keras.MemsaveModel.
      depth, width, batch, classes: model and batch size.
      jit_compile: compile's jit_compile (True: the step is compiled by XLA).
    Returns:
      {"peak": bytes, "losses": [first epoch's loss, measured epoch's loss]}.
    """
    import keras

    from memsave.measure import peak_memory_bytes

    import contextlib

    model = build_model(depth, width, classes, None if patched else checkpoints)
    model.compile(optimizer=keras.optimizers.SGD(0.05),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=jit_compile)
    x, y = synthetic_batch(batch, width, classes)
    if patched:
        import memsave
        context = memsave.patch(checkpoints=checkpoints)
    else:
        context = contextlib.nullcontext()
    with context:
        first = model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False)
        peak, history = peak_memory_bytes(
            lambda: model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False))
    return {"peak": int(peak),
            "losses": [float(first.history["loss"][0]), float(history.history["loss"][0])]}


def compare(strategies=("memory",), timeout=600, jobs=1, **sizes):
    """Plain Keras and each memsave strategy, each in its own process.

    Args:
      strategies: memsave strategies to compare with plain Keras.
      timeout: seconds per process.
      jobs: processes run at once (peaks are per process, so running them side by
        side does not mix them; only wall time changes).
      **sizes: depth, width, batch, classes, jit_compile.
    Returns:
      A list of rows {"config", "peak", "ratio", "losses"}: plain Keras first, then
      memsave.keras per strategy, then plain Keras under memsave.patch per strategy.
    """
    env = {"PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    configs = [(None, False)] + [(s, False) for s in strategies] + [(s, True) for s in strategies]

    def run(config):
        checkpoints, patched = config
        return measure.run_isolated(TARGET, timeout=timeout, env=env, checkpoints=checkpoints,
                                    patched=patched, **sizes)

    with concurrent.futures.ThreadPoolExecutor(max(1, jobs)) as pool:
        results = list(pool.map(run, configs))
    base = results[0]
    rows = []
    for (checkpoints, patched), result in zip(configs, results):
        label = ("keras (GradientTape)" if checkpoints is None else
                 f"keras under memsave.patch ({checkpoints})" if patched else
                 f"memsave.keras ({checkpoints})")
        rows.append({"config": label,
                     "peak": result["peak"], "ratio": result["peak"] / base["peak"],
                     "losses": result["losses"]})
    return rows


def format_rows(rows):
    """The rows as a Markdown table."""
    lines = ["| config | peak MiB | x keras | losses |", "|---|---:|---:|---|"]
    for row in rows:
        losses = ", ".join(f"{v:.6f}" for v in row["losses"])
        lines.append(f"| {row['config']} | {row['peak'] / 2**20:.1f} | {row['ratio']:.2f} | "
                     f"{losses} |")
    return "\n".join(lines)


def main(argv=None):
    """Command line: measure and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--depth", type=int, default=DEFAULTS["depth"])
    parser.add_argument("--width", type=int, default=DEFAULTS["width"])
    parser.add_argument("--batch", type=int, default=DEFAULTS["batch"])
    parser.add_argument("--checkpoints", nargs="+", default=["memory"],
                        choices=["memory", "speed", "collection"])
    parser.add_argument("--jobs", type=int, default=1, help="processes run at once")
    parser.add_argument("--jit", action="store_true", help="compile with jit_compile=True (XLA)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    rows = compare(tuple(args.checkpoints), jobs=args.jobs, depth=args.depth, width=args.width,
                   batch=args.batch, jit_compile=args.jit)
    print(f"Keras fit step, {args.depth} x Dense({args.width}, tanh), batch {args.batch}"
          + (", jit_compile=True (XLA)" if args.jit else ""))
    print(format_rows(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
