"""Peak memory of Keras `model.fit`: plain Keras against memsave.keras and against
plain Keras under `memsave.patch` (its fit's tf.GradientTape computed by memsave).

    python benchmarks/keras_fit_memory.py                      # 24 Dense layers, batch 2048
    python benchmarks/keras_fit_memory.py --depth 48 --width 512 --checkpoints memory speed
    python benchmarks/keras_fit_memory.py --model gpt --examples 17 --optimizer adam --plan-batch 1
    python benchmarks/keras_fit_memory.py --model gpt2 --examples 17 --optimizer adam
    python benchmarks/keras_fit_memory.py --keras 2 --model cnn --examples 65 --optimizer adam

Each configuration runs in its own process (`memsave.measure.run_isolated`, BFC
allocator on): build the model (a deep tanh MLP, or benchmarks.models' GPT from Keras
layers; a conv-BN-ReLU residual CNN; seeded), compile with SGD or Adam (jit_compile=False in all, so all run the same
executor; --jit: True in all, so all are compiled by XLA), fit one epoch to trace and
warm up, then fit one more epoch while the allocator records its peak. An epoch is one
batch by default, which Keras traces with a static batch; `--examples 2*batch+1` leaves
a partial last batch, and Keras traces its step with a batch of None, as most fits do:
memsave then plans for the batch fit is given (`--plan-batch 1` adds rows planned for a
batch of 1, what memsave did before it read fit's batch). The losses of both epochs are
returned, so the parent can check that memsave trains exactly like Keras. `--keras 2`
builds the MLP or the CNN with Keras 2 (`tf_keras`, whose batch norm is fused:
`pip install "tf-keras==X.Y.*"` for TensorFlow X.Y); memsave.keras is Keras 3's, so
Keras 2 rows are plain `fit` and `fit` under the patch.

Columns: peak MiB (allocator peak during the measured epoch: weights, optimizer state,
data, activations, gradients), x keras (that peak divided by plain Keras'), predicted
MiB (memsave's prediction of the step, and of tf.gradients' in brackets, both with the
optimizer's state and update: memsave.beside), planned batch (what unknown
dimensions were counted as; "static" where Keras knew the batch), losses.
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
CNN_IMAGE = (32, 32, 3)  # (the CNN's input: CIFAR-shaped)


def keras_module(version=3):
    """Keras 3 (`keras`) or Keras 2 (`tf_keras`), imported."""
    if version == 3:
        import keras
        return keras
    try:
        import tf_keras
    except ImportError as error:
        raise ImportError("Keras 2 rows need tf_keras: pip install \"tf-keras==X.Y.*\" for "
                          "TensorFlow X.Y") from error
    return tf_keras


def build_model(depth, width, classes, memsave_checkpoints=None, seed=0, model="mlp",
                keras_version=3):
    """A deep tanh MLP or a conv-BN-ReLU residual CNN, functional; a
    memsave.keras.MemsaveModel if checkpoints are given (Keras 3 only).

    Args:
      depth: number of hidden Dense(width, tanh) layers (mlp), or of residual blocks of
        two 3x3 convolutions (cnn).
      width: units per hidden layer and input features (mlp), or channels (cnn).
      classes: output classes (softmax-free logits).
      memsave_checkpoints: None for a plain keras.Model, else the memsave strategy.
      seed: weight-initialisation seed (the same in every process).
      model: "mlp" or "cnn".
      keras_version: 3 (keras) or 2 (tf_keras).
    Returns:
      An uncompiled Keras model.
    """
    keras = keras_module(keras_version)
    keras.utils.set_random_seed(seed)
    layers = keras.layers
    if model == "cnn":
        inputs = keras.Input(CNN_IMAGE)
        h = layers.Conv2D(width, 3, padding="same", name="stem")(inputs)
        for i in range(depth):
            r = h
            for j in range(2):
                h = layers.Conv2D(width, 3, padding="same", use_bias=False,
                                  name=f"conv_{i}_{j}")(h)
                h = layers.BatchNormalization(name=f"bn_{i}_{j}")(h)
                h = layers.Add()([h, r]) if j else h
                h = layers.ReLU()(h)
        h = layers.GlobalAveragePooling2D()(h)
    else:
        inputs = keras.Input((width,))
        h = inputs
        for i in range(depth):
            h = layers.Dense(width, activation="tanh", name=f"dense_{i}")(h)
    outputs = layers.Dense(classes, name="logits")(h)
    if memsave_checkpoints is None:
        return keras.Model(inputs, outputs)
    import memsave
    return memsave.keras.MemsaveModel(inputs, outputs, checkpoints=memsave_checkpoints)


def synthetic_batch(batch, width, classes, seed=1, model="mlp"):
    """A seeded batch (features or CIFAR-shaped images, float32; integer labels)."""
    import numpy as np
    rng = np.random.RandomState(seed)
    shape = (batch,) + (CNN_IMAGE if model == "cnn" else (width,))
    return (rng.randn(*shape).astype("float32"),
            rng.randint(0, classes, size=(batch,)).astype("int32"))


SEQUENCE_MODELS = {"gpt": "GPT (Keras layers)", "gpt2": "keras-hub GPT2CausalLM"}


def _sequence_model_and_data(model, depth, examples):
    """benchmarks.models' GPT (Keras layers) or keras-hub's GPT-2 as a keras.Model, and
    `examples` sequences."""
    from benchmarks import models
    bench = models.build_model(model, depth=depth or None, batch=examples)
    return bench.keras_model, bench.inputs


def _model_and_data(model, checkpoints, patched, depth, width, classes, examples,
                    keras_version):
    """(an uncompiled keras.Model whose fit uses memsave where it should, x, y)."""
    import memsave
    if model in SEQUENCE_MODELS:
        net, (x, y) = _sequence_model_and_data(model, depth, examples)
        if checkpoints is not None and not patched:
            memsave.keras.enable(net, checkpoints=checkpoints)
        return net, x, y
    net = build_model(depth, width, classes, None if patched else checkpoints, model=model,
                      keras_version=keras_version)
    x, y = synthetic_batch(examples, width, classes, model=model)
    return net, x, y


def measure_fit_step(checkpoints=None, depth=DEFAULTS["depth"], width=DEFAULTS["width"],
                     batch=DEFAULTS["batch"], classes=DEFAULTS["classes"], jit_compile=False,
                     patched=False, model="mlp", examples=None, optimizer="sgd",
                     plan_batch=None, keras_version=3):
    """In a fresh process: peak bytes of one `fit` epoch, and what memsave planned.

    Args:
      checkpoints: None for plain Keras, else the memsave strategy name.
      patched: a plain keras.Model fitted under memsave.patch(checkpoints=...), not a
        memsave.keras model.
      model: "mlp" (a deep tanh MLP of `depth` x Dense(`width`)), "cnn" (`depth`
        residual conv-BN-ReLU blocks of `width` channels on 32x32 images), "gpt"
        (benchmarks.models' GPT from Keras layers, `depth` blocks) or "gpt2" (keras-hub's
        GPT2CausalLM, `depth` layers: pip install keras-hub).
      depth, width, batch, classes: model and batch size.
      examples: examples in the epoch (default `batch`: one full batch, which Keras
        traces with a static batch; one more than a multiple of `batch` leaves a partial
        last batch, and Keras traces its step with a batch of None, as most fits do).
      optimizer: "sgd" or "adam" (Adam holds two slots per weight).
      plan_batch: fit inside memsave.batch_size(plan_batch) (1: the plan memsave made
        before it read fit's batch); None: the batch fit is given.
      jit_compile: compile's jit_compile (True: the step is compiled by XLA).
      keras_version: 3 (keras) or 2 (tf_keras: the mlp or the cnn, plain or patched).
    Returns:
      {"peak": bytes, "losses": [first epoch's loss, measured epoch's loss], and, where
      memsave planned the step, "predicted", "predicted_baseline" (bytes), "planned_batch",
      "unknown_dims", "beside" (what the plan held beside the gradients: the optimizer's
      state) and "optimizer_bytes" (its variables' bytes)}.
    """
    import contextlib

    import memsave
    from memsave.integrations import keras_batch
    from memsave.measure import peak_memory_bytes

    keras = keras_module(keras_version)
    examples = examples or batch
    net, x, y = _model_and_data(model, checkpoints, patched, depth, width, classes, examples,
                                keras_version)
    net.compile(optimizer=(keras.optimizers.Adam(1e-3) if optimizer == "adam"
                           else keras.optimizers.SGD(0.05)),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                jit_compile=jit_compile)
    context = contextlib.ExitStack()
    if patched:
        context.enter_context(memsave.patch(checkpoints=checkpoints))
    if plan_batch:
        context.enter_context(memsave.batch_size(plan_batch, source="--plan-batch"))

    def fit():
        return net.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False)

    with context:
        first = fit()
        report = memsave.last_report() if checkpoints is not None else None
        peak, history = peak_memory_bytes(fit)
    result = {"peak": int(peak),
              "losses": [float(first.history["loss"][0]), float(history.history["loss"][0])]}
    if report is not None:
        result.update(predicted=report.predicted_peak_bytes,
                      predicted_baseline=report.baseline_peak_bytes,
                      planned_batch=report.unknown_dim_size if report.unknown_dims else None,
                      unknown_dims=report.unknown_dims, beside=report.beside_bytes,
                      optimizer_bytes=sum(int(v.numpy().nbytes) for v in
                                          keras_batch.optimizer_variables(net.optimizer)))
    return result


def compare(strategies=("memory",), timeout=600, jobs=1, plan_batches=(None,), **sizes):
    """Plain Keras and each memsave strategy, each in its own process.

    Args:
      strategies: memsave strategies to compare with plain Keras.
      timeout: seconds per process.
      jobs: processes run at once (peaks are per process, so running them side by
        side does not mix them; only wall time changes).
      plan_batches: memsave's rows for each (None: the batch fit is given; an int: planned
        for that batch instead, measure_fit_step's plan_batch).
      **sizes: depth, width, batch, classes, jit_compile, model, examples, optimizer,
        keras_version (see measure_fit_step).
    Returns:
      A list of rows {"config", "peak", "ratio", "losses"}: plain Keras first, then
      memsave.keras per strategy (Keras 3), then plain Keras under memsave.patch per
      strategy.
    """
    env = {"PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    ways = (False, True) if sizes.get("keras_version", 3) == 3 else (True,)
    configs = [(None, False, None)] + [
        (s, patched, planned) for patched in ways for s in strategies
        for planned in plan_batches]

    def run(config):
        checkpoints, patched, planned = config
        return measure.run_isolated(TARGET, timeout=timeout, env=env, checkpoints=checkpoints,
                                    patched=patched, plan_batch=planned, **sizes)

    with concurrent.futures.ThreadPoolExecutor(max(1, jobs)) as pool:
        results = list(pool.map(run, configs))
    base = results[0]
    rows = []
    for (checkpoints, patched, planned), result in zip(configs, results):
        label = ("keras (GradientTape)" if checkpoints is None else
                 f"keras under memsave.patch ({checkpoints})" if patched else
                 f"memsave.keras ({checkpoints})")
        if planned:
            label += f", planned for batch {planned}"
        rows.append(dict(result, config=label, ratio=result["peak"] / base["peak"]))
    return rows


def format_rows(rows):
    """The rows as a Markdown table (memsave's rows with its prediction of the step's
    gradients, the optimizer's update not included, and the batch it planned for)."""
    lines = ["| config | peak MiB | x keras | predicted MiB (tf.gradients') | planned batch "
             "| losses |", "|---|---:|---:|---|---:|---|"]
    for row in rows:
        losses = ", ".join(f"{v:.6f}" for v in row["losses"])
        predicted = ("" if row.get("predicted") is None else
                     f"{row['predicted'] / 2**20:.1f} ({row['predicted_baseline'] / 2**20:.1f})")
        planned = "" if row.get("predicted") is None else str(row.get("planned_batch") or "static")
        lines.append(f"| {row['config']} | {row['peak'] / 2**20:.1f} | {row['ratio']:.2f} | "
                     f"{predicted} | {planned} | {losses} |")
    return "\n".join(lines)


def main(argv=None):
    """Command line: measure and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["mlp", "cnn", *SEQUENCE_MODELS], default="mlp",
                        help="a deep tanh MLP, a conv-BN-ReLU residual CNN, benchmarks.models' "
                             "GPT from Keras layers, or keras-hub's GPT2CausalLM (gpt2: pip "
                             "install keras-hub)")
    parser.add_argument("--keras", type=int, choices=[3, 2], default=3,
                        help="Keras 3 (keras) or Keras 2 (tf_keras; mlp and cnn)")
    parser.add_argument("--depth", type=int, default=None,
                        help=f"layers (mlp, default {DEFAULTS['depth']}) or blocks (cnn: 8, "
                             "gpt, gpt2: 6)")
    parser.add_argument("--width", type=int, default=None,
                        help=f"units (mlp, default {DEFAULTS['width']}) or channels (cnn: 32)")
    parser.add_argument("--batch", type=int, default=None,
                        help=f"fit's batch_size (mlp: {DEFAULTS['batch']}, cnn: 32, gpt, gpt2: 8)")
    parser.add_argument("--examples", type=int, default=None,
                        help="examples per epoch (default: one batch, which Keras traces with "
                             "a static batch; 2 x batch + 1 leaves a partial batch, and a "
                             "step traced with a batch of None)")
    parser.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd")
    parser.add_argument("--checkpoints", nargs="+", default=["memory"],
                        choices=["memory", "speed", "collection"])
    parser.add_argument("--plan-batch", type=int, nargs="+", default=None,
                        help="memsave rows planned for these batches instead of fit's (1: "
                             "what memsave planned before it read fit's batch)")
    parser.add_argument("--jobs", type=int, default=1, help="processes run at once")
    parser.add_argument("--jit", action="store_true", help="compile with jit_compile=True (XLA)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    sequence = args.model in SEQUENCE_MODELS
    if args.keras == 2 and sequence:
        parser.error("--keras 2 builds the mlp or the cnn")
    cnn = args.model == "cnn"
    depth = args.depth or (6 if sequence else 8 if cnn else DEFAULTS["depth"])
    width = args.width or (32 if cnn else DEFAULTS["width"])
    batch = args.batch or (8 if sequence else 32 if cnn else DEFAULTS["batch"])
    rows = compare(tuple(args.checkpoints), jobs=args.jobs, depth=depth, width=width,
                   batch=batch, jit_compile=args.jit, model=args.model,
                   examples=args.examples, optimizer=args.optimizer, keras_version=args.keras,
                   plan_batches=[None] + (args.plan_batch or []))
    shape = (f"{SEQUENCE_MODELS[args.model]}, {depth} blocks" if sequence
             else f"{depth} conv-BN-ReLU blocks of {width} channels" if cnn
             else f"{depth} x Dense({width}, tanh)")
    print(f"Keras {args.keras} fit epoch, {shape}, batch {batch}, {args.examples or batch} "
          f"examples, {args.optimizer}" + (", jit_compile=True (XLA)" if args.jit else ""))
    print(format_rows(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
