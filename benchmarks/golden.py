"""A golden snapshot of what memsave builds, to show a refactoring kept behaviour.

For a handful of steps (a v1 chain, the MLP, the default CNN, a small transformer, an
XLA step, an offload step, a budget) it records the report's fields, the segment
boundaries, and the counts of op types and control edges memsave adds to the graph.
Run it before and after a change, then compare the two files:

    python benchmarks/golden.py --out before.json      # on the old code
    python benchmarks/golden.py --out after.json       # on the new code
    python benchmarks/golden.py --compare before.json after.json

Nothing is timed or run: the graphs are only built (a few seconds each). The memory
model's figures depend on the kernels the machine runs (oneDNN, TensorFlow's own,
a GPU), so compare snapshots taken on one machine.
"""

import argparse
import collections
import dataclasses
import json
import os
import sys

import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import memsave  # noqa: E402
import models  # noqa: E402


def _built(graph, before):
    """Op types and control edges among the ops made after the first `before`."""
    new_ops = graph.get_operations()[before:]
    types = collections.Counter(op.type for op in new_ops)
    control_edges = sum(len(op.control_inputs) for op in new_ops)
    return {"ops": len(new_ops), "op_types": dict(sorted(types.items())),
            "control_edges": control_edges}


def _report_fields(report):
    fields = dataclasses.asdict(report)
    fields.pop("segments")
    return fields


def _snapshot(graph, before, report):
    result = {"report": _report_fields(report),
              "segments": [[s.ends_at, s.copied_ops, s.recomputed_ops, s.recomputed_bytes]
                           for s in report.segments]}
    result.update(_built(graph, before))
    return result


def _v1_chain(strategy, offload=False, length=24):
    graph = tf.Graph()
    # (Offloaded from /CPU:0 to /CPU:1: only built, so the second CPU need not exist.)
    with graph.as_default(), tf.device("/CPU:0" if offload else None):
        x = tf.compat.v1.placeholder(tf.float32, [512, 256])
        rng = np.random.RandomState(0)
        ws = [tf.Variable(rng.standard_normal([256, 256]).astype(np.float32) / 16)
              for _ in range(length)]
        h = x
        for w in ws:
            h = tf.tanh(tf.matmul(h, w))
        loss = tf.reduce_sum(h * h)
        before = len(graph.get_operations())
        with memsave.always_rewrite():
            memsave.gradients(loss, [x] + ws, checkpoints=strategy, offload=offload)
        return _snapshot(graph, before, memsave.last_report())


def _traced(name, differentiate, jit_compile=False, **options):
    """The snapshot of `differentiate(loss, variables)` (which returns a report) traced
    in a tf.function step of model `name`."""
    model = models.build_model(name, **options)
    snapshot = {}

    def step(*inputs):
        loss = model.loss(*inputs)
        graph = tf.compat.v1.get_default_graph()
        before = len(graph.get_operations())
        report = differentiate(loss, model.variables)
        snapshot.update(_snapshot(graph, before, report))
        return loss

    function = tf.function(step, autograph=False, jit_compile=jit_compile)
    function.get_concrete_function(*model.inputs)
    return snapshot


def _function_step(name, strategy, jit_compile=False, **options):
    def differentiate(loss, variables):
        with memsave.always_rewrite():
            memsave.gradients(loss, variables, checkpoints=strategy)
        return memsave.last_report()
    return _traced(name, differentiate, jit_compile, **options)


def _plan_only(name, strategy, **options):
    """memsave.plan on a model: its report, and that it added no op."""
    return _traced(name, lambda loss, variables: memsave.plan(loss, variables,
                                                              checkpoints=strategy), **options)


CASES = {
    "v1_chain/memory": lambda: _v1_chain("memory"),
    "v1_chain/speed": lambda: _v1_chain("speed"),
    "v1_chain/offload": lambda: _v1_chain("memory", offload=memsave.Offload("/CPU:1", min_bytes=0)),
    "v1_chain/budget": lambda: _v1_chain(memsave.budget(0.8)),
    "mlp/memory": lambda: _function_step("mlp", "memory", depth=12, batch=256),
    "mlp/collection": lambda: _function_step("mlp", "collection", depth=12, batch=256),
    "cnn/memory": lambda: _function_step("cnn", "memory"),
    "cnn/speed": lambda: _function_step("cnn", "speed"),
    "cnn/budget": lambda: _function_step("cnn", memsave.budget(0.5)),
    "transformer/memory": lambda: _function_step("transformer", "memory", depth=2, batch=4,
                                                 seq_len=32),
    "transformer/xla": lambda: _function_step("transformer", "memory", jit_compile=True,
                                              depth=2, batch=4, seq_len=32),
    "cnn/xla": lambda: _function_step("cnn", "memory", jit_compile=True, depth=20, batch=8),
    "cnn/plan": lambda: _plan_only("cnn", "memory"),
}


def record():
    return {name: build() for name, build in CASES.items()}


def compare(before, after):
    """The differences between two snapshots, as lines (none when identical)."""
    lines = []
    for name in sorted(set(before) | set(after)):
        if name not in before or name not in after:
            lines.append(f"{name}: only in {'after' if name in after else 'before'}")
            continue
        a, b = before[name], after[name]
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                lines.append(f"{name}: {key} differs:\n  before {a.get(key)}\n  after  {b.get(key)}")
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="write the snapshot here")
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"),
                        help="compare two snapshots; exit 1 where they differ")
    args = parser.parse_args()
    if args.compare:
        with open(args.compare[0]) as f, open(args.compare[1]) as g:
            differences = compare(json.load(f), json.load(g))
        print("\n".join(differences) or "identical")
        sys.exit(1 if differences else 0)
    snapshot = record()
    text = json.dumps(snapshot, indent=1, sort_keys=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
        print(f"{len(snapshot)} cases written to {args.out}")
    else:
        print(text)


if __name__ == "__main__":
    main()
