"""What is alive at the measured peak of one training step, next to the memory model's view.

    python benchmarks/peak_breakdown.py --model keras --app ResNet50 --image-size 96  # 'memory'
    python benchmarks/peak_breakdown.py --model cnn --strategy tf.gradients --top 10
    python benchmarks/peak_breakdown.py --model keras --app ResNet50 --image-size 96 \
        --mixed-precision bfloat16 --at conv2_block3_3_bn_1/batchnorm/mul_1_grad

    python benchmarks/peak_breakdown.py --model vit --function  # as a tf.function

Where the measured peak and the model disagree, this says why. The step runs in its
own process (`memsave.measure.run_isolated`, BFC allocator on) as a tf.compat.v1
Session, traced once with `FULL_TRACE`: TensorFlow then records every allocation
and deallocation of the step with the op that made it and the size of the
allocator's chunk (which may be larger than the tensor: BFC does not split a free
chunk for a request of more than half its size). Replaying those records gives the
bytes alive at every moment; at the largest moment, this prints them by kind:

  forward     tensors of the forward pass (checkpoints, and what is not recomputed);
  recomputed  the rewrite's copies (ops memsave added under a `recompute` name scope);
  gradients   every other op the gradients call added, and within them
  grads of xs the returned gradients' buffers;

plus the weights (resident before the step: the model's `resident_bytes`; with
`--function`, the step runs as the tf.function a training loop calls, traced by
TensorFlow's profiler, and this is what the allocator held before it), the BFC
allocator's own peak for the process, and the memory model's prediction for the same
plan (peak, where, and its breakdown), with the largest tensors the model holds at its
own peak, to set beside the measured ones. `--at NAME` shows the moment the first op
whose name contains NAME allocates instead of the peak: the model's peak op's gradient,
to compare the two at the same point of the step. A kind may hold buffers forwarded
from another (an elementwise op writes into its input's buffer when nobody else reads
it): the record names the op that allocated it.
"""

import argparse
import collections
import os
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from benchmarks import compare  # noqa: E402
from memsave import measure  # noqa: E402

CHILD_TARGET = "benchmarks.peak_breakdown:measure_breakdown"
BASELINE = "tf.gradients"
MiB = 2**20


def _gradients(loss, variables, strategy):
    import memsave
    import tensorflow as tf

    if strategy == BASELINE:
        return tf.gradients(loss, variables), memsave.plan(loss, variables, "memory")
    strategy, chunked, chunk = strategy.partition("+chunk:")  # (as compare.py reads it)
    checkpoints = compare.budget_of(strategy) if strategy.startswith(compare.BUDGETS) else strategy
    with memsave.recompute_loops(None, chunk=int(chunk) if chunked and chunk != "auto"
                                 else "auto"):
        return memsave.gradients(loss, variables, checkpoints=checkpoints), memsave.last_report()


def _kind(name, forward_names, gradient_names):
    """The kind of buffer op `name` allocates. memsave names its copies
    `.../recompute/<original name>`; their gradients sit under a `gradients` scope
    before that."""
    if name in forward_names:
        return "forward"
    if name in gradient_names:
        return "grads of xs"
    scope, recompute, _ = name.partition("/recompute/")
    if recompute and "gradients" not in scope.split("/"):
        return "recomputed"
    return "gradients"


def _allocations(run_metadata):
    """(time, bytes, op name) of every allocation (+) and deallocation (-) of the step."""
    events = []
    for device in run_metadata.step_stats.dev_stats:
        for node in device.node_stats:
            for memory in node.memory:
                events += [(record.alloc_micros, record.alloc_bytes, node.node_name)
                           for record in memory.allocation_records]
    return sorted(events)


def _live_at_peak(events, at=None):
    """(peak bytes, {op name: bytes alive at the peak}); with `at` (part of an op's
    name), at the first allocation of an op so named instead (the model's peak op's
    gradient, to set the two side by side), or (0, {}) where none is."""
    live, peak, peak_index = 0, 0, -1
    for index, (_, nbytes, name) in enumerate(events):
        live += nbytes
        if at is None and live > peak:
            peak, peak_index = live, index
        elif at is not None and at in name and nbytes > 0:
            peak, peak_index = live, index
            break
    alive = collections.Counter()
    for _, nbytes, name in events[:peak_index + 1]:
        alive[name] += nbytes
    return peak, {name: nbytes for name, nbytes in alive.items() if nbytes > 0}


def measure_breakdown(model="cnn", strategy="memory", depth=None, batch=None, top=15,
                      model_options=None, at=None, function=False):
    """Child side: the live buffers at the step's peak, and the model's prediction; the
    step run as a tf.compat.v1 Session, or with `function` as the tf.function a training
    loop (and the tests, and compare.py) calls."""
    import tensorflow as tf

    from benchmarks.models import build_model

    if function:
        bench = build_model(model, depth=depth, batch=batch, **(model_options or {}))
        traced = _traced_function_step(bench, strategy, top)
    else:
        with tf.Graph().as_default():
            bench = build_model(model, depth=depth, batch=batch, **(model_options or {}))
            traced = _traced_session_step(bench, strategy, top)
    peak, alive = _live_at_peak(traced["events"], at)
    by_kind = collections.Counter()
    forward_names, gradient_names = traced["forward_names"], traced["gradient_names"]
    for name, nbytes in alive.items():
        by_kind[_kind(name, forward_names, gradient_names)] += nbytes
    largest = sorted(alive.items(), key=lambda item: -item[1])[:top]
    report, (model_at, model_largest) = traced["report"], traced["model_view"]
    predicted = report.baseline_peak_bytes if strategy == BASELINE else report.predicted_peak_bytes
    return {
        "model": model, "strategy": strategy, "function": bool(function),
        "bfc_peak": tf.config.experimental.get_memory_info(measure.memory_device())["peak"],
        "resident": traced.get("resident", report.resident_bytes), "records_peak": peak,
        "by_kind": dict(by_kind),
        "largest": [(name, traced["op_types"].get(name, "?"),
                     _kind(name, forward_names, gradient_names), nbytes)
                    for name, nbytes in largest],
        "predicted": predicted,
        "predicted_at": report.baseline_peak_at if strategy == BASELINE else report.peak_at,
        "model_at": model_at, "model_largest": model_largest, "at": at,
    }


def _traced_session_step(bench, strategy, top):
    """The step in a tf.compat.v1 Session, its second run traced with FULL_TRACE: its
    allocation records, and what the gradients call built and predicted."""
    import tensorflow as tf

    graph = tf.compat.v1.get_default_graph()
    loss = bench.loss(*[tf.constant(value) for value in bench.inputs])
    traced = _built(graph, loss, bench.variables, strategy, top)
    traced["op_types"] = {op.name: op.type for op in graph.get_operations()}
    options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
    metadata = tf.compat.v1.RunMetadata()
    with tf.compat.v1.Session(graph=graph) as session:
        session.run(tf.compat.v1.global_variables_initializer())
        session.run(traced["grads"])  # Grappler, executor and allocator set up
        session.run(traced["grads"], options=options, run_metadata=metadata)
    traced["events"] = _allocations(metadata)
    return traced


def _traced_function_step(bench, strategy, top):
    """The step as a tf.function, its third call traced by TensorFlow's profiler (a
    function's runs leave no RunMetadata): its allocations and deallocations, what the
    allocator held before it (`resident`: weights, inputs, and whatever the process
    keeps; what of it the step frees is not taken off), and what the gradients call
    built and predicted while it was traced (the op types: of the whole traced graph)."""
    import tempfile

    import tensorflow as tf

    traced = {}

    def grad_fn(ys, xs):
        traced.update(_built(ys.graph, ys, xs, strategy, top))
        return traced["grads"]

    step = bench.make_step(grad_fn)
    inputs = [measure.device_input(value) for value in bench.inputs]
    for _ in range(2):  # (traced, then Grappler's and the allocator's first run done)
        step(*inputs)
    device = measure.memory_device()
    with tempfile.TemporaryDirectory() as logdir:
        traced["resident"] = tf.config.experimental.get_memory_info(device)["current"]
        tf.profiler.experimental.start(logdir)
        try:
            # (an embedding's gradient is IndexedSlices: its values are the buffer)
            [getattr(g, "values", g).numpy() for g in step(*inputs)[1] if g is not None]
        finally:
            tf.profiler.experimental.stop()
        traced["events"] = _profiled_allocations(logdir)
    traced["op_types"] = {op.name: op.type for op in
                          step.get_concrete_function(*inputs).graph.get_operations()}
    return traced


def _built(graph, loss, variables, strategy, top):
    """The gradients of `loss` by `strategy` in `graph`, the names of the forward pass's
    ops (those there before) and of the ops making the gradients, the report, and the
    model's view of its own peak."""
    forward_names = {op.name for op in graph.get_operations()}
    grads, report = _gradients(loss, variables, strategy)
    return {"grads": grads, "report": report, "forward_names": forward_names,
            "gradient_names": {_allocating_op(g.op).name for g in grads if g is not None},
            "model_view": _model_view(loss, variables, report, strategy, top)}


def _profiled_allocations(logdir):
    """(time, bytes, op name) of every allocation (+) and deallocation (-) of the busiest
    allocator (the device's, where the step's tensors live) that TensorFlow's profiler
    recorded under `logdir`: an allocation's bytes are its chunk's (as the allocation
    records'), a deallocation names the op whose chunk it frees, and at one moment a
    deallocation comes first (its address may be allocated again then). (Not
    memsave.calibration's memory profile, which keeps at most 1000 allocations: a ViT's
    step makes thousands.)"""
    from memsave.graph import _tf_private

    events = []
    for space in _tf_private.profiler_spaces(logdir):
        for plane in space.planes:
            kinds = {key: meta.name for key, meta in plane.event_metadata.items()}
            stat_names = {key: meta.name for key, meta in plane.stat_metadata.items()}
            for line in plane.lines:
                for event in line.events:
                    kind = kinds.get(event.metadata_id)
                    if kind in ("MemoryAllocation", "MemoryDeallocation"):
                        stats = {stat_names.get(stat.metadata_id): _stat_value(plane, stat)
                                 for stat in event.stats}
                        events.append((line.timestamp_ns * 1000 + event.offset_ps,
                                       kind == "MemoryAllocation", stats))
    busiest = collections.Counter(stats.get("allocator_name") for _, _, stats in events)
    chosen = busiest.most_common(1)[0][0] if busiest else None
    events = sorted((e for e in events if e[2].get("allocator_name") == chosen),
                    key=lambda event: event[:2])
    chunks, records = {}, []
    for time_ps, allocates, stats in events:
        address = stats.get("addr")
        if allocates:
            name = str(stats.get("tf_op") or "?")
            nbytes = int(stats.get("allocation_bytes") or 0)
            chunks[address] = (nbytes, name)
            records.append((time_ps, nbytes, name))
        elif address in chunks:  # (freed in the step: made in it)
            nbytes, name = chunks.pop(address)
            records.append((time_ps, -nbytes, name))
    return records


def _stat_value(plane, stat):
    """An XStat's value: its string (held in the plane's stat metadata where it is a
    reference), or its number."""
    kind = stat.WhichOneof("value")
    if kind == "ref_value":
        return plane.stat_metadata[stat.ref_value].name
    return getattr(stat, kind) if kind else None


def _model_view(loss, variables, report, strategy, top):
    """Where the memory model's live tensors peak for the plan, and its largest buffers
    there (MemoryModel.largest_at_peak)."""
    from memsave import inputs, planner
    from memsave.region import ForwardRegion

    call = inputs.normalise_call([loss], variables)
    model = planner.model_of(ForwardRegion.build(call.ys, call.xs))
    if strategy == BASELINE or report.fallback:
        return model.largest_at_peak(top=top)
    graph = loss.graph
    checkpoints = [model.graph.id_of(graph.get_tensor_by_name(c.name)) for c in report.checkpoints]
    return model.largest_at_peak(checkpoints, report.reads_checkpoints, top,
                                 report.reads_last_segment)


def _allocating_op(op):
    """The op whose buffer `op`'s output is: through identities, which forward their input."""
    while op.type in ("Identity", "Snapshot") and op.inputs:
        op = op.inputs[0].op
    return op


# What the bytes held before the step are called: the model's resident bytes (a
# Session's records), or what the allocator held (a tf.function's profile).
_RESIDENT_LABEL = {False: "weights (resident)", True: "held before the step"}


def format_breakdown(result):
    moment = (f"when {result['at']!r} first allocates" if result.get("at")
              else "at the step's peak")
    lines = [f"{result['model']} / {result['strategy']}: allocator (BFC) peak of the process "
             f"{result['bfc_peak'] / MiB:.1f} MiB; {moment} from its allocation records "
             f"{(result['resident'] + result['records_peak']) / MiB:.1f} MiB, of which:",
             f"  {_RESIDENT_LABEL[bool(result.get('function'))]:<18} "
             f"{result['resident'] / MiB:8.1f} MiB"]
    for kind in ("forward", "recomputed", "gradients", "grads of xs"):
        lines.append(f"  {kind:<18} {result['by_kind'].get(kind, 0) / MiB:8.1f} MiB")
    lines.append(f"memory model: {result['predicted'] / MiB:.1f} MiB, at {result['predicted_at']}")
    where = "then" if result.get("at") else "at the peak"
    lines.append(f"largest buffers alive {where} (allocator chunks):")
    lines += [f"  {nbytes / MiB:7.2f} MiB  {kind:<11} {op_type:<22} {name}"
              for name, op_type, kind, nbytes in result["largest"]]
    lines.append(f"largest tensors the memory model holds at its own peak ({result['model_at']}):")
    lines += [f"  {nbytes / MiB:7.2f} MiB  {kind:<11} {what}"
              for nbytes, kind, what in result["model_largest"]]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="cnn", choices=compare.MODELS)
    parser.add_argument("--strategy", default="memory",
                        help="tf.gradients, a memsave strategy name ('memory', 'speed', ...), "
                        "or budget:F (memsave.budget(F))")
    parser.add_argument("--depth", type=int)
    parser.add_argument("--batch", type=int)
    parser.add_argument("--app", help="keras.applications model for --model keras")
    parser.add_argument("--mixed-precision", choices=compare.MIXED_PRECISION, default=None,
                        help="build a Keras model under Keras' mixed precision policy")
    parser.add_argument("--image-size", type=int)
    parser.add_argument("--top", type=int, default=15, help="largest buffers to list")
    parser.add_argument("--at", metavar="NAME",
                        help="instead of the peak, what is alive when the first op whose name "
                        "contains NAME allocates (e.g. the model's peak op's gradient, "
                        "'conv2_block3_3_bn_1/batchnorm/mul_1_grad')")
    parser.add_argument("--function", action="store_true",
                        help="run the step as a tf.function (as training loops, the tests and "
                        "compare.py do), its allocations recorded by TensorFlow's profiler, "
                        "instead of a tf.compat.v1 Session's run: the executor's order, and "
                        "so the allocator's placement, may differ between the two")
    parser.add_argument("--timeout", type=int, default=1200)
    args = parser.parse_args(argv)
    options = {}
    if args.app:
        options["app"] = args.app
    if args.mixed_precision:
        options["mixed_precision"] = args.mixed_precision
    if args.image_size:
        options["image_size"] = args.image_size
    result = measure.run_isolated(CHILD_TARGET, timeout=args.timeout, model=args.model,
                                  strategy=args.strategy, depth=args.depth, batch=args.batch,
                                  top=args.top, model_options=options, at=args.at,
                                  function=args.function)
    print(format_breakdown(result))
    return result


if __name__ == "__main__":
    main()
