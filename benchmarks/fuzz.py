"""Random graphs, differentiated by tf.gradients and by every memsave strategy, compared.

Each graph is drawn from a seed (so a failure is reproduced by its seed alone) over
many op kinds: elementwise ops, broadcasting, matmuls and convolutions (weights
among the xs or not), batch-norm moments, softmax, seeded dropout (stateful: never
recomputed differently) and stateless dropout, embedding gathers (a variable read
whole then gathered, as a Keras Embedding does, a resource gather, or a computed
table), `tf.cond`, `tf.while_loop`, an RNN over TensorArrays, calls of nested `tf.function`s
(reading a weight, compiled by XLA, or drawing dropout), `tf.custom_gradient`s that are not linear in
their incoming gradient (clipping, normalising), concatenation with split, long
skips, stop_gradient; several ys (scalar or not) with or without grad_ys,
stop_gradients, an intermediate x. Everything is float64, so rounding cannot hide
a wrong rewrite. Graph kinds: tf.compat.v1 graphs (control flow v2, and v1
control flow) and tf.function bodies.

Loops are recomputed (memsave.recompute_loops('always')) in chunks of 1, 2 or 3
iterations, by the seed (`loop_chunk`). Every strategy is built with the rewrite forced
(memsave.always_rewrite()): 'memory',
'speed', 'collection', random checkpoint lists (with xs, ys and tensors off the
path among them), budgets and a time budget. A graph passes when every gradient equals
tf.gradients' (relative error <= 1e-12, memsave's tests' measure, or absolute error
<= 1e-13 for rounding noise of gradients that are zero in exact arithmetic), IndexedSlices
stay IndexedSlices, no stateful op is copied and every custom gradient function is
called as often as tf.gradients calls it (the memory model's scratch probes
aside). A budget no plan meets is refused with a MemsaveError and counted apart.

    python benchmarks/fuzz.py --graphs 10000 --jobs 2
    python benchmarks/fuzz.py --seed 1234 --graphs 1 -v     # one graph, in detail

tests/test_fuzz.py runs a few hundred of these graphs.
"""

import argparse
import json
import multiprocessing
import os
import sys
import time
import traceback
import warnings
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
for _path in (REPO_ROOT, REPO_ROOT / "tests"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

BATCH, WIDTH, VOCAB = 4, 6, 10
RTOL = 1e-12
# Absolute errors this small pass: float64 rounding noise of gradients that are zero in
# exact arithmetic (the gradient of a sum of batch-normalised values), whose summation
# order Grappler may change; a wrong rewrite is off by orders of magnitude more.
ATOL = 1e-13
GRAPH_KINDS = ("v1", "v1_control_flow", "function")
CALL_KINDS = ("plain", "jit", "dropout")
UNARY = ("tanh", "sin", "sigmoid", "softplus", "square", "scale", "stop_gradient", "softmax",
         "dropout", "stateless_dropout", "moments", "clip_custom", "normalise_custom")
BINARY = ("add", "sub", "mul", "residual", "broadcast", "cond")
OTHER = ("matmul", "conv", "concat_split", "gather", "while", "tensor_array", "call")


# -- drawing a graph --------------------------------------------------------------------------

def random_spec(seed):
    """A random graph as plain data (JSON-able), drawn from `seed`."""
    rng = np.random.RandomState(seed)
    n_inputs = int(rng.randint(1, 3))
    nodes = [["input", [i]] for i in range(n_inputs)] + [["constant", []]]
    for _ in range(int(rng.randint(2, 16))):
        # Mostly recent nodes, sometimes far back (long skips).
        def earlier():
            if rng.rand() < 0.3:
                return int(rng.randint(0, len(nodes)))
            return int(max(0, len(nodes) - 1 - rng.geometric(0.5) + 1))
        family = rng.choice(["unary", "binary", "other"], p=[0.45, 0.3, 0.25])
        if family == "unary":
            nodes.append([str(rng.choice(UNARY)), [earlier()]])
        elif family == "binary":
            nodes.append([str(rng.choice(BINARY)), [earlier(), earlier()]])
        else:
            op = str(rng.choice(OTHER))
            if op == "concat_split":
                args = [earlier(), earlier()]
                nodes.append(["split0", args])
                nodes.append(["split1", args])
            elif op == "gather":
                nodes.append(["gather", [earlier()], str(rng.choice(["read", "resource", "tensor"])),
                              bool(rng.rand() < 0.5)])
            elif op in ("while", "tensor_array"):
                nodes.append([op, [earlier(), earlier()], int(rng.randint(1, 4))])
            elif op == "call":
                nodes.append([op, [earlier()], str(rng.choice(CALL_KINDS))])
            else:
                nodes.append([op, [earlier()], int(rng.randint(0, 2))])
    last = len(nodes) - 1
    ys = sorted(set([last] + [int(i) for i in rng.randint(n_inputs, last + 1,
                                                          size=rng.randint(0, 3))]))
    candidates = list(range(-len(ys), last + 1))  # -1 - i: the i-th y
    lists = [sorted(set(int(c) for c in rng.choice(candidates, size=rng.randint(1, 7))))
             for _ in range(rng.randint(1, 4))]
    return {
        "seed": int(seed), "n_inputs": n_inputs, "nodes": nodes, "ys": ys,
        "scalar_ys": [bool(rng.rand() < 0.7) for _ in ys],
        "grad_ys": bool(rng.rand() < 0.4),
        "weights_are_xs": bool(rng.rand() < 0.6),
        "intermediate_x": int(rng.randint(n_inputs, last + 1)) if rng.rand() < 0.15 else None,
        "stop_gradients": [int(i) for i in rng.randint(0, last + 1, size=rng.randint(0, 3))]
        if rng.rand() < 0.2 else [],
        "lists": lists,
        "budgets": [0.99, float(rng.choice([0.95, 0.9, 0.8]))],
        "kind": str(rng.choice(GRAPH_KINDS, p=[0.4, 0.2, 0.4])),
    }


# -- building it ------------------------------------------------------------------------------

class CustomGradientCalls:
    """Counts custom gradient calls made into the step's graph (not the memory model's
    scratch probes, memsave_probe_*)."""

    def __init__(self):
        self.count = 0

    def record(self, dy):
        if not getattr(dy.graph, "name", "").startswith("memsave_probe"):
            self.count += 1


def _custom(kind, calls):
    import tensorflow as tf

    @tf.custom_gradient
    def clipped(t):
        def grad(dy):
            calls.record(dy)
            return tf.clip_by_value(dy * t, -0.2, 0.2)
        return 0.5 * t * t, grad

    @tf.custom_gradient
    def normalised(t):
        def grad(dy):
            calls.record(dy)
            return dy * tf.cos(t) / (1.0 + tf.reduce_sum(tf.abs(dy)))
        return tf.sin(t), grad

    return clipped if kind == "clip_custom" else normalised


class _Builder:
    """Builds one spec's graph; `weights(...)` are variables or constants."""

    def __init__(self, spec, inputs, variable, calls):
        import tensorflow as tf
        self.tf = tf
        self.spec = spec
        self.inputs = inputs
        self.variable = variable
        self.calls = calls
        self.weights = []  # (tensor or variable) that may be xs
        rng = np.random.RandomState(spec["seed"] + 1)
        self.matrices = [self._weight(f"w{i}", rng.uniform(-1, 1, [WIDTH, WIDTH]) / WIDTH ** 0.5)
                         for i in range(2)]
        self.filters = [self._weight(f"f{i}", rng.uniform(-0.5, 0.5, [2, 2, 1, 1]))
                        for i in range(2)]
        self.table = self._weight("table", rng.uniform(-1, 1, [VOCAB, WIDTH]), variable=True)
        self.gamma = self._weight("gamma", rng.uniform(0.5, 1.5, [1, WIDTH]))

    def _weight(self, name, value, variable=None):
        tf = self.tf
        if variable is None:  # (the first of each kind is a variable, an x, where asked)
            variable = self.spec["weights_are_xs"] and name in ("w0", "f0", "gamma")
        if variable:
            w = self.variable(name, lambda: tf.Variable(value, dtype=tf.float64, name=name))
        else:
            w = tf.constant(value, tf.float64, name=name)
        self.weights.append(w)
        return w

    def build(self):
        tf = self.tf
        tensors, splits = [], {}
        for node in self.spec["nodes"]:
            op, args = node[0], node[1]
            if op == "input":
                tensors.append(self.inputs[f"x{args[0]}"])
            elif op == "constant":
                tensors.append(tf.sin(tf.ones([BATCH, WIDTH], tf.float64)))
            elif op in ("split0", "split1"):
                key = tuple(args)
                if key not in splits or op == "split0":
                    joined = tf.concat([tensors[args[0]], tf.tanh(tensors[args[1]])], axis=1)
                    splits[key] = tf.split(joined, 2, axis=1)
                tensors.append(splits[key][0 if op == "split0" else 1])
            else:
                tensors.append(self._op(node, [tensors[a] for a in args]))
        return tensors

    def _op(self, node, args):
        tf = self.tf
        op = node[0]
        a = args[0]
        b = args[1] if len(args) > 1 else None
        simple = {
            "tanh": tf.tanh, "sin": tf.sin, "sigmoid": tf.sigmoid,
            "softplus": tf.nn.softplus, "stop_gradient": tf.stop_gradient,
            "square": lambda t: 0.5 * t * t, "scale": lambda t: 0.7 * t,
            "softmax": lambda t: tf.nn.softmax(t, axis=-1),
            "add": lambda t: t + b, "sub": lambda t: t - b, "mul": lambda t: t * b,
            "residual": lambda t: t + tf.tanh(b),
        }
        if op in simple:
            return simple[op](a)
        if op == "dropout":  # stateful: a recomputation must reuse its draw
            return tf.nn.dropout(a, rate=0.5, seed=self.spec["seed"] % 1000)
        if op == "stateless_dropout":
            return tf.nn.experimental.stateless_dropout(
                a, rate=0.5, seed=[1, self.spec["seed"] % 1000])
        if op == "moments":  # a batch norm, with its statistics
            mean, variance = tf.nn.moments(a, axes=[0], keepdims=True)
            return (a - mean) * tf.math.rsqrt(variance + 1e-3) * self.gamma
        if op in ("clip_custom", "normalise_custom"):
            return _custom(op, self.calls)(a)
        if op == "broadcast":
            return a * tf.reduce_mean(b, axis=0, keepdims=True) + 0.1 * tf.reduce_sum(
                b, axis=1, keepdims=True)
        if op == "cond":
            return tf.cond(tf.reduce_sum(a) > 0.0, lambda: tf.tanh(a) * b,
                           lambda: tf.sin(b) - 0.5 * a)
        if op == "matmul":
            return tf.matmul(a, self.matrices[node[2]])
        if op == "conv":
            image = tf.reshape(a, [BATCH, 2, WIDTH // 2, 1])
            return tf.reshape(tf.nn.conv2d(image, self.filters[node[2]], 1, "SAME"),
                              [BATCH, WIDTH])
        if op == "gather":
            return self._gather(a, node[2], node[3])
        if op == "while":
            steps = node[2]
            return tf.while_loop(lambda i, c: i < steps,
                                 lambda i, c: (i + 1, tf.tanh(0.9 * c + 0.1 * b)), [0, a])[1]
        if op == "tensor_array":  # an RNN over the rows: unstack, loop, stack
            return self._rnn(a, b)
        if op == "call":
            return self._call(a, node[2])
        raise AssertionError(op)

    def _call(self, a, kind):
        """A nested tf.function reading a weight (recomputable: memsave copies the call),
        compiled by XLA ('jit'), or drawing a dropout mask (stateful: never copied)."""
        tf = self.tf
        matrix = self.matrices[0 if kind == "plain" else 1]

        def body(t):
            out = tf.tanh(tf.matmul(t, matrix)) + 0.1 * t
            if kind == "dropout":
                out = tf.nn.dropout(out, rate=0.5, seed=self.spec["seed"] % 1000 + 1)
            return out
        return tf.function(body, jit_compile=kind == "jit", autograph=False)(a)

    def _rnn(self, a, b):
        tf = self.tf
        steps = tf.TensorArray(tf.float64, size=BATCH).unstack(a)

        def body(t, state, outputs):
            state = tf.tanh(0.9 * state + steps.read(t) * b[0])
            return t + 1, state, outputs.write(t, state)

        _, _, outputs = tf.while_loop(
            lambda t, *_: t < BATCH, body,
            (0, tf.zeros([WIDTH], tf.float64), tf.TensorArray(tf.float64, size=BATCH)))
        return outputs.stack()

    def _gather(self, a, table_kind, ids_from_data):
        tf = self.tf
        if ids_from_data:
            ids = tf.cast(tf.abs(tf.reduce_sum(a, axis=1)) * 3.0, tf.int32) % VOCAB
        else:
            ids = tf.constant([1, 3, 3, 7][:BATCH])
        if table_kind == "tensor":
            table = tf.concat([a, 0.5 * a, tf.tanh(a)[:VOCAB - 2 * BATCH]], axis=0)
            return tf.gather(table, ids) + 0.0 * a
        if not isinstance(self.table, tf.Variable):
            return tf.gather(self.table, ids) * a
        if table_kind == "read":  # a Keras 3 Embedding: the whole table read, rows gathered
            return tf.gather(self.table.value(), ids) * a
        return tf.nn.embedding_lookup(self.table, ids) * a


def build_case(spec, inputs, variable, calls):
    """The graph of `spec`: (ys, xs, grad_ys or None, stop_gradients, lists, tensors)."""
    import tensorflow as tf
    builder = _Builder(spec, inputs, variable, calls)
    tensors = builder.build()
    ys = []
    for k, (i, scalar) in enumerate(zip(spec["ys"], spec["scalar_ys"])):
        ys.append(tf.reduce_sum(tensors[i] * (1.0 + 0.1 * k)) if scalar else tensors[i])
    xs = [tensors[i] for i in range(spec["n_inputs"])]
    xs += [w for w in builder.weights if isinstance(w, tf.Variable)]
    if spec["intermediate_x"] is not None:
        xs.append(tensors[spec["intermediate_x"]])
    grad_ys = None
    if spec["grad_ys"]:
        rng = np.random.RandomState(spec["seed"] + 2)
        grad_ys = [tf.constant(rng.uniform(0.5, 1.5, y.shape.as_list()), tf.float64) for y in ys]
    # (Not at a call's output: tf.gradients differentiates a call through a
    # SymbolicGradient op there, which fails for a jit-compiled function.)
    stop = [tensors[i] for i in spec["stop_gradients"] if spec["nodes"][i][0] != "call"]

    def tensor_of(index):
        return ys[-1 - index] if index < 0 else tensors[index]

    lists = [[tensor_of(i) for i in subset] for subset in spec["lists"]]
    return ys, xs, grad_ys, stop, lists


def strategies_of(spec, lists):
    import memsave
    result = [("memory", "memory"), ("speed", "speed"), ("collection", "collection")]
    result += [(f"list{i}", list(checkpoints)) for i, checkpoints in enumerate(lists)]
    result += [(f"budget{b}", memsave.budget(b)) for b in spec["budgets"]]
    # (a time budget: the lowest peak within 1.3x the step time; drawn from no random
    # stream, so every seed's graph stays the one it was)
    result.append(("time1.3", memsave.budget(time=1.3)))
    return result


# -- checking it ------------------------------------------------------------------------------

def loop_chunk(seed):
    """The chunk a graph's loop copies run in (memsave.recompute_loops(chunk=)): 1, 2
    or 3 iterations by the seed (its loops run BATCH or fewer)."""
    return 1 + seed % 3


def check(spec):
    """Builds and evaluates one spec. Returns a dict: status 'ok', 'mismatch' or 'crash',
    'refused' (strategies that refused a budget), and 'problems' (messages)."""
    import tensorflow as tf

    import memsave
    from _gradcheck import _fetchable, assert_same_gradients, evaluate, stateful_copies
    from _gradcheck import variable_store

    problems, refused, sparse = [], [], {}
    feeds = {f"x{i}": np.random.RandomState(spec["seed"] + 10 + i).uniform(-1, 1, [BATCH, WIDTH])
             for i in range(spec["n_inputs"])}
    variable = variable_store()

    def body(graph, inputs):
        calls = CustomGradientCalls()
        ys, xs, grad_ys, stop, lists = build_case(spec, inputs, variable, calls)
        kwargs = {"grad_ys": grad_ys}
        if stop:
            kwargs["stop_gradients"] = stop
        for t in lists[0]:
            memsave.mark_checkpoint(t)
        reference = tf.compat.v1.gradients(ys, xs, **kwargs)
        expected_calls = calls.count
        sparse["tf"] = [isinstance(g, tf.IndexedSlices) for g in reference]
        fetches = {"tf": [None if g is None else _fetchable(g) for g in reference]}
        for label, checkpoints in strategies_of(spec, lists):
            before_ops, before_calls = len(graph.get_operations()), calls.count
            try:
                with warnings.catch_warnings(), memsave.always_rewrite(), \
                        memsave.recompute_loops("always", chunk=loop_chunk(spec["seed"])):
                    warnings.simplefilter("ignore", memsave.MemsaveWarning)
                    got = memsave.gradients(ys, xs, checkpoints=checkpoints, **kwargs)
            except memsave.MemsaveError as error:
                if label.startswith("budget") and "cannot be met" in str(error):
                    refused.append(label)
                    continue
                raise
            made = calls.count - before_calls
            if made != expected_calls:
                problems.append(f"{label}: custom gradients called {made} times, "
                                f"tf.gradients {expected_calls}")
            bad = stateful_copies(graph.get_operations()[before_ops:])
            if bad:
                problems.append(f"{label}: stateful ops copied: {bad}")
            sparse[label] = [isinstance(g, tf.IndexedSlices) for g in got]
            fetches[label] = [None if g is None else _fetchable(g) for g in got]
        return fetches

    kind = "v1" if spec["kind"].startswith("v1") else "function"
    v1_control_flow = spec["kind"] == "v1_control_flow"
    try:
        if v1_control_flow:
            tf.compat.v1.disable_control_flow_v2()
        values = evaluate(kind, body, feeds)
    except Exception:  # a crash of any kind is what the fuzz looks for
        return {"status": "crash", "refused": refused,
                "problems": [traceback.format_exc(limit=6)]}
    finally:
        if v1_control_flow:
            tf.compat.v1.enable_control_flow_v2()
    for label, got in values.items():
        if label == "tf":
            continue
        try:
            assert_same_gradients(values["tf"], got, rtol=RTOL, label=label, atol=ATOL)
        except AssertionError as error:
            problems.append(str(error))
        if sparse[label] != sparse["tf"]:
            problems.append(f"{label}: IndexedSlices {sparse[label]}, tf.gradients "
                            f"{sparse['tf']}")
    return {"status": "mismatch" if problems else "ok", "refused": refused,
            "problems": problems}


# -- running many -----------------------------------------------------------------------------

def _worker(seeds):
    import tensorflow as tf
    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    results = []
    for seed in seeds:
        spec = random_spec(seed)
        result = check(spec)
        result["seed"] = seed
        result["kind"] = spec["kind"]
        results.append(result)
    return results


# A process checks this many chunks, then a fresh one takes over: every graph leaves
# memory behind in the process (TensorFlow's caches of functions and kernels), about 9 MB
# a graph; one process checking 1,700 graphs held 14.8 GB.
CHUNKS_PER_PROCESS = 20


def run(first_seed, count, jobs=1, chunk=25):
    """Checks graphs of seeds first_seed .. first_seed + count - 1; yields results. Up to
    CHUNKS_PER_PROCESS chunks run in this process; more run in `jobs` worker processes,
    each replaced after that many."""
    seeds = list(range(first_seed, first_seed + count))
    chunks = [seeds[i:i + chunk] for i in range(0, len(seeds), chunk)]
    if jobs <= 1 and len(chunks) <= CHUNKS_PER_PROCESS:
        for c in chunks:
            yield from _worker(c)
        return
    context = multiprocessing.get_context("spawn")
    with context.Pool(max(jobs, 1), maxtasksperchild=CHUNKS_PER_PROCESS) as pool:
        for results in pool.imap_unordered(_worker, chunks):
            yield from results


def code_digest():
    """A digest of the source files of the memsave these graphs run (found without
    importing it): runs that print the same digest tested the same code, whatever the
    commit."""
    import hashlib
    import importlib.util
    root = Path(importlib.util.find_spec("memsave").submodule_search_locations[0])
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--graphs", type=int, default=200, help="how many graphs (default 200)")
    parser.add_argument("--seed", type=int, default=0, help="the first graph's seed")
    parser.add_argument("--jobs", type=int, default=1, help="processes (default 1)")
    parser.add_argument("--json", help="write every failing graph's spec and problems here")
    parser.add_argument("-v", "--verbose", action="store_true", help="print every problem")
    args = parser.parse_args(argv)
    start = time.time()
    counts = {"ok": 0, "mismatch": 0, "crash": 0}
    by_kind, refused, failures = {}, 0, []
    for done, result in enumerate(run(args.seed, args.graphs, args.jobs), 1):
        counts[result["status"]] += 1
        by_kind[result["kind"]] = by_kind.get(result["kind"], 0) + 1
        refused += len(result["refused"])
        if result["status"] != "ok":
            failures.append(result)
            print(f"seed {result['seed']} ({result['kind']}): {result['status']}: "
                  f"{result['problems'][0].splitlines()[-1] if not args.verbose else result['problems']}",
                  flush=True)
        if done % 500 == 0:
            print(f"... {done} graphs, {time.time() - start:.0f} s", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(
            [dict(f, spec=random_spec(f["seed"])) for f in failures], indent=1))
    kinds = ", ".join(f"{k} {n}" for k, n in sorted(by_kind.items()))
    print(f"memsave fuzz: {args.graphs} graphs (seeds {args.seed}..{args.seed + args.graphs - 1}; "
          f"{kinds}) in {time.time() - start:.0f} s: {counts['ok']} exact, "
          f"{counts['mismatch']} mismatches, {counts['crash']} crashes; {refused} budgets "
          "refused as unreachable; memsave code " + code_digest())
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
