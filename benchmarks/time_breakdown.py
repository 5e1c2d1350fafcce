"""Where a plan's step time goes: its recomputed ops, and what the rewrite costs beyond them.

    python benchmarks/time_breakdown.py --model transformer --strategy memory
    python benchmarks/time_breakdown.py --model cnn --strategy budget:0.5 --steps 9

The model's training step runs in this process twice, as tf.functions: with tf.gradients
and with memsave's strategy. Both are timed side by side (memsave.measure.time_paired:
the step-time ratio the benchmarks report), then `--profiled` steps of each are recorded
by TensorFlow's profiler, and the time of every op the executor ran is summed by kind:

- forward: the forward pass's ops (those in the graph before the gradients call);
- recomputed: memsave's copies of forward ops (its segments' `recompute` scopes);
- backward: every other op the gradients call made (the gradient functions' ops);
- bookkeeping: identities, snapshots and no-ops the gradients call made (memsave's
  gates and reads, tf.gradients' own);
- other: ops the graph does not name as such (Grappler's rewrites and fusions).

Then: the step-time ratio the recomputed ops alone would give (1 + their time over
tf.gradients' step, its wall time), what the measured ratio adds beyond that, how
much of the op time ran side by side (op time over the step's wall time: the
rewrite's ordering edges lower it), the recomputed ops' time by op type, and the op
types whose time changed most outside the recomputation (a fusion Grappler no longer
makes shows as more, smaller ops of the fused types). `--variants` times the plan
without its ordering edges and recomputing ahead, each where that changes the plan (a
budget's plan has no ordering edges: timing the same step again would show only the
noise between runs).

Op times are the executor's (each op's wall time on its inter-op thread, its Eigen
work included), so they add to more than the step where two ops run at once. With
TF_NUM_INTEROP_THREADS=1 both steps run one op at a time, each op on all cores, as a
GPU's stream runs its kernels: what is beyond the recomputation there is not the
executor's overlap.
"""

import argparse
import collections
import os
import statistics
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import models  # noqa: E402

KINDS = ("forward", "recomputed", "backward", "bookkeeping", "other")
BOOKKEEPING_TYPES = frozenset({"Identity", "IdentityN", "NoOp", "Snapshot", "StopGradient"})
BASELINE = "tf.gradients"


# What the rewrite adds to a plan besides its copies, to time without it (--variants):
# each a change of the strategy's Selection (memsave.strategies.Selection).
VARIANTS = {
    "without ordering edges": {"order_backward": False},
    "recomputing ahead": {"recompute_ahead": True},
}


def _checkpoints(strategy, changes=None):
    import dataclasses

    import memsave
    from memsave import strategies

    from benchmarks.compare import BUDGETS, budget_of
    if strategy.startswith(BUDGETS):  # (as compare.py reads them)
        checkpoints = budget_of(strategy)
    elif strategy in strategies.STRATEGIES:
        checkpoints = strategy
    else:
        raise SystemExit(f"--strategy is {strategy!r}; expected one of "
                         f"{', '.join(sorted(strategies.STRATEGIES))}, budget:F or time:T")
    if not changes:
        return checkpoints
    planner = strategies.STRATEGIES[checkpoints] if isinstance(checkpoints, str) else checkpoints

    def changed(problem):
        return dataclasses.replace(strategies.selection_of(planner(problem)), **changes)
    changed.__name__ = f"{strategy} {changes}"
    return changed


def _step(bench, strategy, built, changes=None):
    """The model's step as a tf.function whose gradients call is `strategy`'s (its
    Selection changed by `changes`); `built` gets, per trace, the names of the forward
    ops and what the call made."""
    import memsave
    import tensorflow as tf

    def grad_fn(loss, variables):
        graph = loss.graph
        before = {op.name for op in graph.get_operations()}
        if strategy == BASELINE:
            grads = tf.gradients(loss, variables)
            report = None
        else:
            grads = memsave.gradients(loss, variables,
                                      checkpoints=_checkpoints(strategy, changes))
            report = memsave.last_report()
        made = {op.name: op.type for op in graph.get_operations() if op.name not in before}
        built.update(forward=before, made=made, report=report)
        return grads

    return bench.make_step(grad_fn)


def kind_of(name, built):
    """Which kind of work the op named `name` (as the executor ran it) does."""
    if name in built["forward"]:
        return "forward"
    # (A segment's gradient ops are named .../gradients/.../recompute/...: of the copies;
    # Grappler's rewrites of copies keep the scope.)
    if "/recompute/" in f"/{name}" and "/gradients/" not in f"/{name}":
        return "recomputed"
    op_type = built["made"].get(name)
    if op_type is None:
        return "other"
    if op_type in BOOKKEEPING_TYPES:
        return "bookkeeping"
    return "backward"


def profiled_op_times(call, steps):
    """(name, type, seconds) of every op the executor ran in `steps` calls of `call`,
    as TensorFlow's profiler recorded them, and the calls' wall times."""
    import tensorflow as tf

    from memsave.graph import _tf_private

    with tempfile.TemporaryDirectory() as logdir:
        tf.profiler.experimental.start(logdir)
        try:
            for _ in range(steps):
                call()
        finally:
            tf.profiler.experimental.stop()
        ops, walls = [], []
        for space in _tf_private.profiler_spaces(logdir):
            for plane in space.planes:
                names = {key: meta.name for key, meta in plane.event_metadata.items()}
                for line in plane.lines:
                    for event in line.events:
                        name = names.get(event.metadata_id, "")
                        if name == "KernelAndDeviceFunc::Run":  # (the call, on its thread)
                            walls.append(event.duration_ps * 1e-12)
                        elif (line.name.startswith("tf_Compute") and ":" in name
                              and "::" not in name):
                            op_name, _, op_type = name.rpartition(":")
                            ops.append((op_name, op_type, event.duration_ps * 1e-12))
    return ops, walls


def breakdown(ops, built, steps):
    """Per kind: seconds per step and op runs per step; per op type, outside the
    recomputation and in it: seconds per step."""
    seconds, runs = collections.Counter(), collections.Counter()
    by_type, recomputed_by_type = collections.Counter(), collections.Counter()
    for name, op_type, duration in ops:
        kind = kind_of(name, built)
        seconds[kind] += duration / steps
        runs[kind] += 1 / steps
        (recomputed_by_type if kind == "recomputed" else by_type)[op_type] += duration / steps
    return seconds, runs, by_type, recomputed_by_type


def _fetched(grads):
    """The gradients' values on the host: the step has run to its end."""
    return [getattr(g, "values", g).numpy() for g in grads if g is not None]


def measure_breakdown(model="transformer", strategy="memory", depth=None, batch=None,
                      steps=5, profiled=3, seed=0, variants=False, **model_options):
    """The breakdown of `strategy`'s step against tf.gradients' on `model` (a dict);
    `variants`: also the step-time ratio of the plan changed as each of VARIANTS says,
    with its predicted peak: result["variants"][name] = (ratio, peak bytes), or
    (None, None) where the change leaves the plan as planned (not timed)."""
    import memsave  # noqa: F401  (before TensorFlow's first graph: memsave's setup)
    from memsave import measure

    bench = models.build_model(model, depth=depth, batch=batch, seed=seed, **model_options)
    inputs = [measure.device_input(value) for value in bench.inputs]
    built = {BASELINE: {}, strategy: {}}
    steps_of = {name: _step(bench, name, built[name]) for name in built}
    calls = {name: (lambda step=step: _fetched(step(*inputs)[1]))
             for name, step in steps_of.items()}
    mine, theirs, ratio = measure.time_paired(calls[strategy], calls[BASELINE], repeats=steps,
                                              warmup=2)
    result = {"model": bench.description, "strategy": strategy, "device":
              measure.device_description(), "time_ratio": ratio, "step_s": {
                  strategy: mine, BASELINE: theirs}, "summary": built[strategy]["report"]
              and built[strategy]["report"].summary()}
    result["variants"] = {}
    for variant, changes in (VARIANTS.items() if variants else ()):
        variant_built = {}
        step = _step(bench, strategy, variant_built, changes)
        step.get_concrete_function(*inputs)  # (traced, not run: the call's report)
        report = variant_built["report"]
        if _same_plan(report, built[strategy]["report"]):
            result["variants"][variant] = (None, None)  # (nothing to time: the plan is so)
            continue
        ratio = measure.time_paired(lambda: _fetched(step(*inputs)[1]), calls[BASELINE],
                                    repeats=steps, warmup=2)[2]
        result["variants"][variant] = (ratio, report and report.predicted_peak_bytes)
    for name in (BASELINE, strategy):
        ops, walls = profiled_op_times(calls[name], profiled)
        seconds, runs, by_type, recomputed_by_type = breakdown(ops, built[name], profiled)
        result[name] = {"seconds": seconds, "runs": runs, "by_type": by_type,
                        "recomputed_by_type": recomputed_by_type,
                        "wall_s": statistics.median(walls) if walls else None}
    return result


def _same_plan(variant, planned):
    """Whether a variant's report describes the plan as planned (a budget's plan has no
    ordering edges to take away): the same checkpoints, ordering edges, recomputation
    ahead, and reads of checkpoints and of the last segment. Not where either report
    is missing (nothing shows they are the same)."""
    if variant is None or planned is None:
        return False

    def described(report):
        return ([c.name for c in report.checkpoints], report.orders_backward,
                report.recomputes_ahead, report.reads_checkpoints, report.reads_last_segment)
    return described(variant) == described(planned)


def derived(result):
    """What the breakdown says: the ratio the recomputation alone would give (1 + the
    recomputed ops' time over tf.gradients' step), what the measured ratio adds beyond
    it, and how much ran side by side.

    The recomputed ops' time is taken over tf.gradients' step, its wall time, not over
    its ops' summed time: where two ops run at once on a CPU each takes longer (both
    share the cores), so the summed time overstates the step (the CNN's backward ops:
    273 ms side by side, 182 ms one at a time in memsave's step), and the recomputation
    would look smaller than the time it adds."""
    strategy = result["strategy"]
    theirs, mine = result[BASELINE], result[strategy]
    their_step = theirs["wall_s"] or result["step_s"][BASELINE]
    recomputed = mine["seconds"]["recomputed"]
    alone = 1 + recomputed / their_step if their_step else None

    def side_by_side(part):
        total = sum(part["seconds"].values())
        return total / part["wall_s"] if part["wall_s"] else None

    return {"recomputed_alone": alone,
            "beyond": result["time_ratio"] - alone if alone else None,
            "side_by_side": {BASELINE: side_by_side(theirs), strategy: side_by_side(mine)}}


def _ratio(value, spec=".2f", unit="x"):
    """`value` formatted, or "n/a" where the profile gave nothing to compute it from."""
    return "n/a" if value is None else f"{value:{spec}}{unit}"


def format_breakdown(result, top=8):
    strategy = result["strategy"]
    theirs, mine = result[BASELINE], result[strategy]
    facts = derived(result)
    lines = [f"{result['model']}; {result['device']}",
             f"step time: {strategy} {result['step_s'][strategy] * 1e3:.1f} ms, "
             f"tf.gradients {result['step_s'][BASELINE] * 1e3:.1f} ms: "
             f"{result['time_ratio']:.2f}x (paired median)"]
    if result["summary"]:
        lines.append(result["summary"])
    lines += ["", f"{'op time per step':<22}{'tf.gradients':>22}{strategy:>26}"]
    for kind in KINDS:
        cells = []
        for part in (theirs, mine):
            cells.append(f"{part['seconds'][kind] * 1e3:9.1f} ms ({part['runs'][kind]:5.0f} ops)")
        lines.append(f"{kind:<22}{cells[0]:>22}{cells[1]:>26}")
    totals = [sum(part["seconds"].values()) * 1e3 for part in (theirs, mine)]
    lines.append(f"{'all ops':<22}{totals[0]:>12.1f} ms{'':7}{totals[1]:>16.1f} ms")
    walls = [part["wall_s"] * 1e3 if part["wall_s"] else float("nan") for part in (theirs, mine)]
    lines.append(f"{'step (profiled)':<22}{walls[0]:>12.1f} ms{'':7}{walls[1]:>16.1f} ms")
    lines.append("")
    lines.append(f"the recomputed ops ({mine['seconds']['recomputed'] * 1e3:.1f} ms) alone: "
                 f"{_ratio(facts['recomputed_alone'])}; measured "
                 f"{result['time_ratio']:.2f}x: {_ratio(facts['beyond'], '+.2f', '')} beyond "
                 "the recomputation")
    side = facts["side_by_side"]
    lines.append(f"op time over the step's wall time (what ran side by side): tf.gradients "
                 f"{_ratio(side[BASELINE], '.2f', '')}, {strategy} "
                 f"{_ratio(side[strategy], '.2f', '')}")
    if result.get("variants"):
        lines.append(f"{strategy} as planned: {result['time_ratio']:.2f}x")
    for variant, (ratio, peak) in result.get("variants", {}).items():
        if ratio is None:
            lines.append(f"{strategy} {variant}: the plan as planned (not timed again)")
            continue
        lines.append(f"{strategy} {variant}: {ratio:.2f}x"
                     + (f", predicted peak {peak / 2**20:.1f} MiB" if peak else ""))
    recomputed = mine.get("recomputed_by_type", {})
    if recomputed:
        lines.append("recomputed op types (ms per step): " + ", ".join(
            f"{op_type} {seconds * 1e3:.1f}" for op_type, seconds in
            sorted(recomputed.items(), key=lambda item: -item[1])[:top]))
    changes = sorted(set(theirs["by_type"]) | set(mine["by_type"]),
                     key=lambda t: -abs(mine["by_type"][t] - theirs["by_type"][t]))
    lines.append(f"op types whose time changed most outside the recomputation (ms per step):")
    for op_type in changes[:top]:
        lines.append(f"  {op_type:<32}{theirs['by_type'][op_type] * 1e3:9.1f} ->"
                     f"{mine['by_type'][op_type] * 1e3:9.1f}")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="transformer", choices=sorted(models.MODELS))
    parser.add_argument("--strategy", default="memory",
                        help="memory, speed, collection or budget:F (default memory)")
    parser.add_argument("--depth", type=int, default=None)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--steps", type=int, default=5, help="paired timing rounds")
    parser.add_argument("--profiled", type=int, default=3, help="profiled steps of each")
    parser.add_argument("--variants", action="store_true",
                        help="also time the plan without its ordering edges and recomputing "
                             "ahead (what each costs or buys)")
    parser.add_argument("--app", default=None, help="keras.applications model for --model keras")
    parser.add_argument("--image-size", type=int, default=None)
    parser.add_argument("--d-model", type=int, default=None,
                        help="width of a transformer (--model transformer, vit, gpt, gpt2)")
    parser.add_argument("--heads", type=int, default=None, help="attention heads, with --d-model")
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    options = {k: v for k, v in (("app", args.app), ("image_size", args.image_size),
                                 ("d_model", args.d_model), ("heads", args.heads))
               if v is not None}
    result = measure_breakdown(args.model, args.strategy, args.depth, args.batch, args.steps,
                               args.profiled, variants=args.variants, **options)
    print(format_breakdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
