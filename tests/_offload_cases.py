"""Host-offload configurations that need two logical CPUs: `/CPU:0` plays the
accelerator and `/CPU:1` the host (or, under MirroredStrategy, the two replicas).

Each runs in its own process (memsave.measure.run_isolated), since logical devices
must be configured before TensorFlow starts its runtime. Each returns the largest
difference from tf.gradients and the offload copies of the graph that actually ran
(run metadata: the partitioned graphs), as JSON-able dicts.
"""

import numpy as np
import tensorflow as tf
from tensorflow.python.eager import context

import memsave

WIDTH, DEPTH, BATCH = 16, 6, 8


def _two_cpus():
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()])


def _weights():
    rng = np.random.RandomState(0)
    return [(rng.standard_normal([WIDTH, WIDTH]) / 4).astype(np.float32) for _ in range(DEPTH)]


def _inputs():
    return np.random.RandomState(1).standard_normal([BATCH, WIDTH]).astype(np.float32)


def _forward(x, weights):
    """A tanh MLP; returns the loss and every second layer's output (the checkpoints)."""
    h, marks = x, []
    for i, w in enumerate(weights):
        h = tf.tanh(tf.matmul(h, w))
        if i % 2 == 1 and i < len(weights) - 1:
            marks.append(h)
    return tf.reduce_sum(h * h), marks


def _memsave(loss, weights, marks, offload):
    with memsave.always_rewrite():
        got = memsave.gradients(loss, weights, checkpoints=marks, offload=offload)
    report = memsave.last_report()
    return got, {"offloaded": report.offloaded, "moved": report.offload_moved_bytes}


def _copies(partition_graphs):
    """The offload copies of the partitioned graphs and the nodes that read them."""
    nodes = [node for graph in partition_graphs for node in graph.node]
    copies = [{"name": n.name, "device": n.device, "op": n.op, "inputs": list(n.input)}
              for n in nodes if "offload_" in n.name and n.op == "Snapshot"]
    backs = {c["name"] for c in copies if "offload_back" in c["name"]}
    readers = [{"name": n.name, "device": n.device, "op": n.op}
               for n in nodes if any(i.split(":")[0] in backs for i in n.input)]
    return {"copies": copies, "readers": readers}


def _max_diff(expected, got):
    return max(float(np.max(np.abs(np.asarray(e) - np.asarray(g)))) for e, g in zip(expected, got))


def function_case(prefetch=1):
    """tf.function: the model on /CPU:0, checkpoints offloaded to /CPU:1."""
    _two_cpus()
    weights = [tf.Variable(w) for w in _weights()]
    facts = {}
    offload = memsave.Offload("/CPU:1", min_bytes=0, prefetch=prefetch)

    @tf.function
    def step(x):
        with tf.device("/CPU:0"):
            loss, marks = _forward(x, weights)
            expected = tf.gradients(loss, weights)
            got, facts["report"] = _memsave(loss, weights, marks, offload)
        return expected, got

    context.context().enable_run_metadata()
    expected, got = step(tf.constant(_inputs()))
    metadata = context.context().export_run_metadata()
    context.context().disable_run_metadata()
    ran = [f for f in metadata.function_graphs
           if any("offload_" in n.name for n in f.post_optimization_graph.node)]
    return dict(facts["report"], max_diff=_max_diff(expected, got), graphs=len(ran),
                **_copies([g for f in ran for g in f.partition_graphs]))


def v1_case():
    """A tf.compat.v1 graph in a Session: the model on /CPU:0, checkpoints to /CPU:1."""
    _two_cpus()
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [BATCH, WIDTH])
        with tf.device("/CPU:0"):
            weights = [tf.compat.v1.Variable(w) for w in _weights()]
            loss, marks = _forward(x, weights)
            expected = tf.gradients(loss, weights)
            got, report = _memsave(loss, weights, marks,
                                   memsave.Offload("/CPU:1", min_bytes=0))
        options = tf.compat.v1.RunOptions(output_partition_graphs=True)
        metadata = tf.compat.v1.RunMetadata()
        with tf.compat.v1.Session(graph=graph) as session:
            session.run(tf.compat.v1.global_variables_initializer())
            values = session.run([expected, got], {x: _inputs()}, options=options,
                                 run_metadata=metadata)
    return dict(report, max_diff=_max_diff(*values), graphs=1,
                **_copies(metadata.partition_graphs))


def mirrored_case():
    """MirroredStrategy over /CPU:0 and /CPU:1 with offload=True: each replica's
    checkpoints go to the host of its own task (/CPU:0); replica 0 is there already."""
    _two_cpus()
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        weights = [tf.Variable(w) for w in _weights()]
    x = strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.constant(_inputs() * (1 + ctx.replica_id_in_sync_group)))
    reports = []

    def replica_step(x):
        loss, marks = _forward(x, weights)
        expected = tf.gradients(loss, weights)
        got, report = _memsave(loss, weights, marks, memsave.Offload(min_bytes=0))
        reports.append(report)
        return expected, got

    @tf.function
    def step(x):
        return strategy.run(replica_step, args=(x,))

    context.context().enable_run_metadata()
    expected, got = step(x)
    metadata = context.context().export_run_metadata()
    context.context().disable_run_metadata()
    diffs = [_max_diff([strategy.experimental_local_results(e)[r] for e in expected],
                       [strategy.experimental_local_results(g)[r] for g in got])
             for r in range(2)]
    ran = [f for f in metadata.function_graphs
           if any("offload_" in n.name for n in f.post_optimization_graph.node)]
    return dict(max_diff=max(diffs), reports=reports,
                **_copies([g for f in ran for g in f.partition_graphs]))


def budget_case():
    """memsave.budget(0.5, offload=...) in a v1 Session: a budget recomputation alone
    cannot meet, met by offloading what the planner chose from /CPU:0 to /CPU:1."""
    _two_cpus()
    rng = np.random.RandomState(2)
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [2048, 256])
        with tf.device("/CPU:0"):
            weights = [tf.compat.v1.Variable((rng.standard_normal([256, 256]) / 16)
                                             .astype(np.float32)) for _ in range(16)]
            h = x
            for w in weights:
                h = tf.tanh(tf.matmul(h, w))
            loss = tf.reduce_sum(h * h)
            expected = tf.gradients(loss, weights)
            budget = memsave.budget(0.5, offload="/CPU:1")
            planned = [c.name for c in memsave.plan(loss, weights, checkpoints=budget).checkpoints
                       if c.offloaded]
            got = memsave.gradients(loss, weights, checkpoints=budget)
            report = memsave.last_report()
        options = tf.compat.v1.RunOptions(output_partition_graphs=True)
        metadata = tf.compat.v1.RunMetadata()
        feed = {x: rng.standard_normal([2048, 256]).astype(np.float32)}
        with tf.compat.v1.Session(graph=graph) as session:
            session.run(tf.compat.v1.global_variables_initializer())
            values = session.run([expected, got], feed, options=options, run_metadata=metadata)
    return dict(planned=planned, offloaded=report.offloaded, max_diff=_max_diff(*values),
                **_copies(metadata.partition_graphs))
