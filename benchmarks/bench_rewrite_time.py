"""How long memsave.gradients takes to build its graph, against tf.gradients itself.

    pytest benchmarks/bench_rewrite_time.py                 # pytest-benchmark table
    python benchmarks/bench_rewrite_time.py [--sizes 1000,5000,20000] [--repeats 3]
    python benchmarks/compare.py --build-time               # the same ratio table

The graphs are generated `tf.compat.v1` graphs of about 1k, 5k and 20k ops: a chain
of residual blocks `x = x + tanh(x @ W_i)` (one variable per block, so the
gradient is taken with respect to thousands of variables as in a training step),
with a longer skip every 8 blocks (so the 'memory' strategy meets non-chain
structure: no single tensor separates the graph at a mark, as in DenseNet/U-Net
style graphs), ending in a scalar loss. For the 'collection' strategy, unit
outputs (after a skip add) about sqrt(blocks) blocks apart are marked. Tensors are tiny: this measures graph
construction only, nothing runs.

Each timing builds a fresh graph first (not timed), then times one gradients call.
In script mode every (size, method) runs in its own process under --timeout; a
method that runs past it is reported as "timeout" and not tried on larger graphs.
In pytest mode a case whose time, projected from the previous size with quadratic
growth, would exceed PYTEST_BUDGET_S is skipped with that reason.
Targets: at 20k ops memsave's build (planning and rewrite) takes at most 2x
tf.gradients's for 'memory' (issue 9), 3x for the others (issue 3).
"""

import argparse
import csv
import math
import os
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import memsave  # noqa: E402

SIZES = (1000, 5000, 20000)
STRATEGIES = ("speed", "memory", "collection")
METHODS = ("tf.gradients",) + STRATEGIES
WIDTH = 16
DEFAULT_TIMEOUT_S = 600
SKIP_EVERY = 8


def build_graph(blocks):
    """A fresh tf.Graph with `blocks` residual blocks; returns (graph, loss, variables)."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [4, WIDTH], name="x")
        # Marks on unit outputs (after a skip add), about sqrt(blocks) apart: where a user
        # would mark. The skip tensor (the unit's input) crosses each mark, so a mark is
        # not a separator: a segment that stops only at marks reaches back along the
        # chain of skips (this is what makes 'collection' grow faster than linearly).
        units = max(1, int(round(math.sqrt(max(blocks, 1)) / SKIP_EVERY)))
        mark_every = units * SKIP_EVERY
        variables = []
        skip = x
        for i in range(blocks):
            with tf.name_scope(f"block{i}"):
                w = tf.Variable(tf.zeros([WIDTH, WIDTH]), name="w")
                variables.append(w)
                x = x + tf.tanh(tf.matmul(x, w))
                if (i + 1) % SKIP_EVERY == 0:
                    x, skip = x + skip, x
                if (i + 1) % mark_every == 0:
                    memsave.mark_checkpoint(x)
        loss = tf.reduce_sum(tf.square(x), name="loss")
    return graph, loss, variables


def _ops_per_block():
    small, _, _ = build_graph(SKIP_EVERY)
    empty, _, _ = build_graph(0)
    return (len(small.get_operations()) - len(empty.get_operations())) / SKIP_EVERY


def blocks_for(ops, _cache={}):
    """The block count whose graph has about `ops` ops."""
    if "per_block" not in _cache:
        _cache["per_block"] = _ops_per_block()
    return max(1, int(round(ops / _cache["per_block"])))


def gradient_call(method):
    """A callable (loss, variables) -> gradients for a method name.

    memsave always builds its rewrite here (memsave.always_rewrite): the tensors are
    tiny, so the memory model would rightly choose plain tf.gradients, and this
    measures planning plus rewriting, not that choice.
    """
    if method == "tf.gradients":
        return lambda loss, xs: tf.gradients(loss, xs)

    def call(loss, xs):
        with memsave.always_rewrite():
            return memsave.gradients(loss, xs, checkpoints=method)
    return call


def time_build(method, blocks):
    """(seconds for one gradients call on a fresh graph, ops in the forward graph)."""
    graph, loss, variables = build_graph(blocks)
    ops = len(graph.get_operations())
    call = gradient_call(method)
    with graph.as_default():
        start = time.perf_counter()
        grads = call(loss, variables)
        elapsed = time.perf_counter() - start
    if any(g is None for g in grads):
        raise AssertionError(f"{method}: a variable got no gradient")
    return elapsed, ops


def time_build_child(method, blocks, repeats=1):
    """Child-process entry (run_isolated): best-of-`repeats` build time on fresh graphs."""
    times, ops = [], None
    for _ in range(repeats):
        elapsed, ops = time_build(method, blocks)
        times.append(elapsed)
    return {"seconds": min(times), "ops": ops}


def build_time_rows(sizes=SIZES, strategies=STRATEGIES, repeats=3, isolate=True,
                    timeout=DEFAULT_TIMEOUT_S):
    """One row per size: ops and the best-of-`repeats` build time per method, with ratios.

    With isolate=True each (size, method) runs in its own process under `timeout`
    seconds; a method that runs past it is recorded as None ("timeout") and not
    tried on larger graphs. With isolate=False everything runs in this process.
    """
    from memsave import measure

    methods = ("tf.gradients",) + tuple(strategies)
    timed_out = {}
    rows = []
    for size in sizes:
        blocks = blocks_for(size)
        row = {"target_ops": size, "blocks": blocks, "ops": None}
        for method in methods:
            if method in timed_out:
                row[method] = None
                continue
            if isolate:
                try:
                    result = measure.run_isolated(
                        "benchmarks.bench_rewrite_time:time_build_child", timeout=timeout,
                        env={"PYTHONPATH": str(REPO_ROOT)}, method=method, blocks=blocks,
                        repeats=repeats)
                except measure.IsolatedRunError as error:
                    if error.returncode is not None:
                        raise
                    timed_out[method] = size
                    row[method] = None
                    continue
            else:
                result = time_build_child(method, blocks, repeats)
            row[method], row["ops"] = result["seconds"], result["ops"]
        for strategy in strategies:
            ok = row[strategy] is not None and row["tf.gradients"]
            row[f"{strategy} ratio"] = row[strategy] / row["tf.gradients"] if ok else None
        rows.append(row)
        sys.stderr.write(f"build time, ~{size} ops: " + ", ".join(
            f"{m} " + (f"{row[m]:.2f} s" if row[m] is not None else f"> {timeout} s")
            for m in methods) + "\n")
    return rows


def _seconds(value):
    return "timeout" if value is None else f"{value:.3f}"


def format_rows(rows, strategies=STRATEGIES):
    header = ["ops", "tf.gradients s"]
    for strategy in strategies:
        header += [f"{strategy} s", "x tf"]
    lines = [header]
    for row in rows:
        line = [str(row["ops"] or f"~{row['target_ops']}"), _seconds(row["tf.gradients"])]
        for strategy in strategies:
            ratio = row[strategy + " ratio"]
            line += [_seconds(row[strategy]), "-" if ratio is None else f"{ratio:.2f}"]
        lines.append(line)
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    text = ["  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in lines]
    text.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(text)


def write_csv(rows, path):
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fields = list(dict.fromkeys(key for row in rows for key in row))
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


# ----------------------------------------------------------------------------- pytest-benchmark

# Slow cases are not tried on larger graphs: (method -> (ops, mean seconds)) of the last run.
_LAST = {}
PYTEST_BUDGET_S = 300  # projected seconds (quadratic growth, 3 rounds) above which a case is skipped


@pytest.mark.parametrize("size,method", [(size, method) for size in SIZES for method in METHODS],
                         ids=[f"{size // 1000}k_ops-{method}" for size in SIZES
                              for method in METHODS])
def test_build_time(benchmark, size, method):
    if method in _LAST:
        last_size, last_mean = _LAST[method]
        projected = 3 * last_mean * (size / last_size) ** 2
        if projected > PYTEST_BUDGET_S:
            pytest.skip(f"{method} took {last_mean:.1f} s at ~{last_size} ops; ~{size} ops "
                        f"could take {projected:.0f} s")
    blocks = blocks_for(size)
    call = gradient_call(method)

    def setup():
        graph, loss, variables = build_graph(blocks)
        return (graph, loss, variables), {}

    def build(graph, loss, variables):
        with graph.as_default():
            return call(loss, variables)

    benchmark.extra_info["blocks"] = blocks
    benchmark.group = f"~{size} ops"
    grads = benchmark.pedantic(build, setup=setup, rounds=3, iterations=1)
    _LAST[method] = (size, benchmark.stats.stats.mean)
    assert all(g is not None for g in grads)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)),
                        help="comma-separated target op counts")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--repeats", type=int, default=3, help="fresh graphs per timing (best of)")
    parser.add_argument("--timeout", type=int, default=DEFAULT_TIMEOUT_S,
                        help="seconds per (size, method) process; slower cases are reported "
                             "as timeout and not tried on larger graphs")
    parser.add_argument("--csv", default=None)
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    rows = build_time_rows(sizes, strategies, args.repeats, timeout=args.timeout)
    print(format_rows(rows, strategies))
    if args.csv:
        write_csv(rows, args.csv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
