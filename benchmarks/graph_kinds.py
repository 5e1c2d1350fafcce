"""The same training step's peak run as a `tf.function` and in a `tf.compat.v1` Session.

    python benchmarks/graph_kinds.py --model keras --app ResNet50 --image-size 96 \\
        --mixed-precision bfloat16 --strategies tf.gradients,memory

compare.py measures a `tf.function` step and peak_breakdown.py a Session (its
allocation records need one); where the two disagree, this measures both kinds of
graph for each strategy, each in its own process (`memsave.measure.run_isolated`,
BFC allocator on): the model built in that kind of graph, one step of warm-up, then
the allocator's peak over two steps.
"""

import argparse
import os
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from benchmarks import compare  # noqa: E402
from memsave import measure  # noqa: E402

CHILD_TARGET = "benchmarks.graph_kinds:measure_kind"
KINDS = ("function", "session")
BASELINE = "tf.gradients"


def _gradients(strategy):
    import memsave
    import tensorflow as tf

    if strategy == BASELINE:
        return lambda ys, xs: tf.gradients(ys, xs)
    return lambda ys, xs: memsave.gradients(ys, xs, checkpoints=strategy)


def measure_kind(kind, model="cnn", strategy="memory", model_options=None):
    """Child side: the BFC peak (bytes) of two steps of `model` under `strategy` in a graph
    of `kind` ('function' or 'session')."""
    import tensorflow as tf

    from benchmarks.models import build_model

    device = measure.memory_device()
    grad_fn = _gradients(strategy)
    if kind == "function":
        bench = build_model(model, **(model_options or {}))
        step = bench.make_step(grad_fn)
        inputs = [measure.device_input(value) for value in bench.inputs]
        run = lambda: step(*inputs)  # noqa: E731
    else:
        graph = tf.Graph()
        with graph.as_default():
            bench = build_model(model, **(model_options or {}))
            loss = bench.loss(*[tf.constant(value) for value in bench.inputs])
            grads = grad_fn(loss, bench.variables)
            session = tf.compat.v1.Session(graph=graph)
            session.run(tf.compat.v1.global_variables_initializer())
        run = lambda: session.run(grads)  # noqa: E731
    run()
    tf.config.experimental.reset_memory_stats(device)
    run()
    run()
    return tf.config.experimental.get_memory_info(device)["peak"]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="cnn", choices=compare.MODELS)
    parser.add_argument("--strategies", default="tf.gradients,memory",
                        help="comma-separated: tf.gradients and memsave strategy names")
    parser.add_argument("--app", help="keras.applications model for --model keras")
    parser.add_argument("--mixed-precision", choices=compare.MIXED_PRECISION, default=None)
    parser.add_argument("--image-size", type=int)
    parser.add_argument("--batch", type=int)
    parser.add_argument("--depth", type=int)
    parser.add_argument("--timeout", type=int, default=1200)
    args = parser.parse_args(argv)
    options = {key: value for key, value in (
        ("app", args.app), ("mixed_precision", args.mixed_precision),
        ("image_size", args.image_size), ("batch", args.batch), ("depth", args.depth))
        if value is not None}
    peaks = {}
    print(f"{'strategy':<14} {'tf.function MiB':>16} {'Session MiB':>12}")
    for strategy in args.strategies.split(","):
        peaks[strategy] = [measure.run_isolated(CHILD_TARGET, timeout=args.timeout, kind=kind,
                                                model=args.model, strategy=strategy,
                                                model_options=options) / 2**20
                           for kind in KINDS]
        print(f"{strategy:<14} {peaks[strategy][0]:16.1f} {peaks[strategy][1]:12.1f}", flush=True)
    return peaks


if __name__ == "__main__":
    main()
