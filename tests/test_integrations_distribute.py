"""memsave under tf.distribute and in hand-built multi-tower graphs.

- MirroredStrategy over two logical CPU devices (configured before TensorFlow
  starts its devices, so in a fresh process): per-replica gradients with
  memsave (through `memsave.patch`) equal plain tf.gradients', every op memsave
  adds stays on its replica's device, and Keras `fit` with a MemsaveModel
  trains exactly like plain Keras.
- MultiWorkerMirroredStrategy: two worker processes on localhost (TF_CONFIG)
  train a few steps with tf.gradients and with memsave; losses match. Both
  workers are stopped when either fails or after a time limit.
- A tf.compat.v1 graph built per tower under tf.device: copies keep their
  tower's device, and the gradients equal tf.gradients'.
"""

import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

import memsave
from memsave.measure import run_isolated

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
# The models are too small to save memory; the children check where the rewrite puts
# its ops, so they build it anyway.
CHILD_ENV = {"PYTHONPATH": os.pathsep.join([HERE, REPO, os.environ.get("PYTHONPATH", "")]),
             "MEMSAVE_ALWAYS_REWRITE": "1"}
MODULE = __name__


def _weights(depth, width, seed=0):
    rng = np.random.RandomState(seed)
    return [(rng.randn(width, width) / np.sqrt(width)).astype(np.float32) for _ in range(depth)]


def _mlp_loss(x, weights):
    h = x
    for w in weights:
        h = tf.tanh(tf.matmul(h, w))
    return tf.reduce_mean(h * h)


def _device_index(device):
    return tf.DeviceSpec.from_string(device).device_index if device else None


def _placement(graph, op, seen=()):
    """(device, anchor): op.device, or for an op only colocated with another (as
    tf.gradients makes them) that op's placement; `anchor` is the op it comes from."""
    if op.device or op in seen:
        return op.device, op
    for group in op.colocation_groups():
        name = group.decode()[len("loc:@"):]
        if name != op.name:
            return _placement(graph, graph.get_operation_by_name(name), seen + (op,))
    return op.device, op


def _misplaced(graph, op, expected_index):
    """Why `op` (added by memsave) is not on device `expected_index`, or None.

    An op with no device is fine only when it is colocated with one of the
    user's own ops that has none either (e.g. a ReadVariableOp of a captured
    handle, which the placer puts on the variable's device): it then goes
    wherever that op goes, as plain tf.gradients' ops do.
    """
    device, anchor = _placement(graph, op)
    if device:
        if _device_index(device) == expected_index:
            return None
        return f"{op.name} ({op.type}) on {device!r}"
    if anchor is not op and "memsave" not in anchor.name.split("/"):
        return None
    return f"{op.name} ({op.type}) has no device and is not colocated with a user op"


def _memsave_ops(graph):
    """The ops memsave added: everything under a name scope called "memsave"."""
    return [op for op in graph.get_operations() if "memsave" in op.name.split("/")]


def _copy_mismatches(graph, ops):
    """Copies ("<scope>/recompute/<original name>") whose device differs from the original's."""
    bad, checked = [], 0
    for op in ops:
        if "/recompute/" not in op.name or "/gradients/" in op.name:
            continue
        original_name = op.name.split("/recompute/", 1)[1]
        try:
            original = graph.get_operation_by_name(original_name)
        except KeyError:
            continue
        checked += 1
        if op.device != original.device:
            bad.append(f"{op.name} on {op.device!r}, original on {original.device!r}")
    return bad, checked


# ------------------------------------------------------------ MirroredStrategy
def mirrored_case(depth=6, width=16, batch=8):
    """In a fresh process with two logical CPUs: gradients and placement under MirroredStrategy."""
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()])
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        weights = [tf.Variable(w) for w in _weights(depth, width)]
    rng = np.random.RandomState(1)
    parts = [rng.randn(batch, width).astype(np.float32) for _ in range(2)]
    x = strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.constant(parts[ctx.replica_id_in_sync_group]))

    def make_step():
        @tf.function
        def step(x):
            return strategy.run(lambda x: tf.gradients(_mlp_loss(x, weights), weights), args=(x,))
        return step

    plain_step = make_step()
    plain = plain_step(x)
    patched_step = make_step()
    with memsave.patch(checkpoints="memory"):
        patched = patched_step(x)  # traced (and run) while patched

    max_diff = 0.0
    for g_plain, g_patched in zip(plain, patched):
        for a, b in zip(strategy.experimental_local_results(g_plain),
                        strategy.experimental_local_results(g_patched)):
            max_diff = max(max_diff, float(np.max(np.abs(a.numpy() - b.numpy()))))

    graph = patched_step.get_concrete_function(x).graph
    ops = _memsave_ops(graph)
    wrong_replica, per_replica = [], [0, 0]
    for op in ops:
        replica = 1 if op.name.startswith("replica_1/") else 0
        per_replica[replica] += 1
        why = _misplaced(graph, op, replica)
        if why:
            wrong_replica.append(why)
    bad_copies, copies = _copy_mismatches(graph, ops)
    plain_ops = len(_memsave_ops(plain_step.get_concrete_function(x).graph))
    return {"max_diff": max_diff, "memsave_ops": per_replica, "wrong_replica": wrong_replica[:10],
            "copies_checked": copies, "bad_copies": bad_copies[:10], "plain_memsave_ops": plain_ops,
            "keras": _mirrored_keras_fit(strategy)}


def _mirrored_keras_fit(strategy, depth=4, width=16):
    import keras

    def fit(model_class, **kwargs):
        with strategy.scope():
            keras.utils.set_random_seed(0)
            inputs = keras.Input((width,))
            h = inputs
            for _ in range(depth):
                h = keras.layers.Dense(width, activation="tanh")(h)
            model = model_class(inputs, keras.layers.Dense(1)(h), **kwargs)
            model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", jit_compile=False)
        rng = np.random.RandomState(2)
        # 66 examples: a partial last batch, so Keras traces the step with a batch of None.
        x, y = rng.randn(66, width).astype("float32"), rng.randn(66, 1).astype("float32")
        history = model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
        return [float(v) for v in history.history["loss"]]

    plain = fit(keras.Model)
    memsave_losses = fit(memsave.keras.MemsaveModel, checkpoints="memory")
    report = memsave.last_report()
    return {"plain": plain, "memsave": memsave_losses,
            "planned": [report.unknown_dim_size, report.unknown_dim_source, report.unknown_dims]}


@pytest.fixture(scope="module")
def mirrored():
    return run_isolated(f"{MODULE}:mirrored_case", timeout=300, env=CHILD_ENV)


def test_mirrored_per_replica_gradients_match(mirrored):
    assert mirrored["plain_memsave_ops"] == 0
    assert mirrored["max_diff"] < 1e-5, mirrored


def test_mirrored_memsave_ops_stay_on_their_replica_device(mirrored):
    assert mirrored["memsave_ops"][0] > 0 and mirrored["memsave_ops"][1] > 0, mirrored
    assert mirrored["wrong_replica"] == [], mirrored["wrong_replica"]
    assert mirrored["copies_checked"] > 0
    assert mirrored["bad_copies"] == [], mirrored["bad_copies"]


def test_mirrored_keras_fit_matches(mirrored):
    keras_losses = mirrored["keras"]
    np.testing.assert_allclose(keras_losses["memsave"], keras_losses["plain"], rtol=1e-5)


def test_mirrored_keras_fit_plans_each_replica_for_its_share_of_the_batch(mirrored):
    # Each replica's step is traced in a thread of its own, inside fit's: 16 over 2 is 8.
    size, source, unknown = mirrored["keras"]["planned"]
    assert unknown > 0 and size == 8, mirrored["keras"]["planned"]
    assert source == "fit's batch_size=16, over 2 replicas"


# ------------------------------------------------------------ multi-tower v1 graph
def test_multi_tower_copies_keep_their_tower_device():
    towers, depth, width = 2, 6, 16
    graph = tf.Graph()
    with graph.as_default():
        with tf.device("/cpu:0"):
            weights = [tf.Variable(w, name=f"w{i}") for i, w in enumerate(_weights(depth, width))]
        feeds, losses = {}, []
        for t in range(towers):
            with tf.device(f"/cpu:{t}"), tf.name_scope(f"tower_{t}"):
                x = tf.compat.v1.placeholder(tf.float32, (8, width), name="x")
                feeds[x] = np.random.RandomState(t).randn(8, width).astype(np.float32)
                losses.append(_mlp_loss(x, weights))
        total = tf.add_n(losses) / towers
        # One call over both towers, and the classic per-tower calls.
        combined = memsave.gradients(total, weights, checkpoints="memory")
        per_tower = []
        for t in range(towers):
            with tf.device(f"/cpu:{t}"), tf.name_scope(f"tower_{t}"):
                per_tower.append(memsave.gradients(losses[t], weights, checkpoints="memory"))
        averaged = [tf.add_n(list(g)) / towers for g in zip(*per_tower)]
        reference = tf.gradients(total, weights)

        ops = _memsave_ops(graph)
        assert ops
        bad, checked = _copy_mismatches(graph, ops)
        assert checked > 0 and bad == [], bad
        # Every op memsave made from tower t's ops (copies and their gradients).
        on_tower = {0: 0, 1: 0}
        for op in ops:
            for t in range(towers):
                if f"recompute/tower_{t}/" in op.name:
                    on_tower[t] += 1
                    assert _misplaced(graph, op, t) is None, _misplaced(graph, op, t)
        assert on_tower[0] > 0 and on_tower[1] > 0

        config = tf.compat.v1.ConfigProto(device_count={"CPU": towers})
        with tf.compat.v1.Session(graph=graph, config=config) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            got_combined, got_averaged, expected = sess.run([combined, averaged, reference], feeds)
    for a, b, c in zip(got_combined, got_averaged, expected):
        np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(b, c, rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------ MultiWorkerMirroredStrategy
STEPS = 3


def mwms_worker(tf_config, steps=STEPS, depth=5, width=16, batch=8):
    """One worker of a two-worker cluster: losses of `steps` SGD steps, plain and memsave.

    TF_CONFIG comes in the environment of this fresh process.
    """
    assert json.loads(os.environ["TF_CONFIG"]) == tf_config
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    task = tf_config["task"]["index"]
    x_value = np.random.RandomState(10 + task).randn(batch, width).astype(np.float32)

    def train(grad_fn):
        with strategy.scope():
            weights = [tf.Variable(w) for w in _weights(depth, width, seed=3)]

        @tf.function
        def step(x):
            def replica_fn(x):
                loss = _mlp_loss(x, weights)
                return loss, grad_fn(loss, weights)

            loss, grads = strategy.run(replica_fn, args=(x,))
            loss = strategy.reduce(tf.distribute.ReduceOp.MEAN, loss, axis=None)
            for w, g in zip(weights, grads):
                w.assign_sub(0.5 * strategy.reduce(tf.distribute.ReduceOp.MEAN, g, axis=None))
            return loss

        x = tf.constant(x_value)
        losses = [float(step(x)) for _ in range(steps)]
        return losses, len(_memsave_ops(step.get_concrete_function(x).graph))

    plain, plain_ops = train(tf.gradients)
    memsaved, memsave_ops = train(memsave.gradient_function("memory"))
    return {"task": task, "plain": plain, "memsave": memsaved, "plain_memsave_ops": plain_ops,
            "memsave_ops": memsave_ops}


def _free_ports(count):
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("localhost", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


_WORKER = """
import json, sys
import {module} as tests
result = tests.mwms_worker(json.loads(sys.argv[1]))
sys.stdout.write("\\nMWMS_RESULT:" + json.dumps(result) + "\\n")
"""


class WorkerFailed(RuntimeError):
    """A MultiWorkerMirroredStrategy worker exited without a result."""


def _run_two_workers(timeout=240):
    """Starts both workers; if one fails or time runs out, stops the other too."""
    ports = _free_ports(2)
    cluster = {"worker": [f"localhost:{port}" for port in ports]}
    procs = []
    try:
        for index in range(2):
            config = {"cluster": cluster, "task": {"type": "worker", "index": index}}
            env = dict(os.environ, **CHILD_ENV, TF_CONFIG=json.dumps(config),
                       TF_CPP_MIN_LOG_LEVEL="2")
            procs.append(subprocess.Popen(
                [sys.executable, "-c", _WORKER.format(module=MODULE), json.dumps(config)],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    results = []
    for index, p in enumerate(procs):
        out, err = p.communicate()
        lines = [line for line in out.splitlines() if line.startswith("MWMS_RESULT:")]
        if p.returncode != 0 or not lines:
            raise WorkerFailed(f"worker {index} exited {p.returncode} without a result "
                               f"(timeout {timeout}s):\n{err[-3000:]}")
        results.append(json.loads(lines[-1][len("MWMS_RESULT:"):]))
    return results


def test_multi_worker_mirrored_two_local_workers():
    # The free ports are picked, then released for the workers to bind: another
    # process may take one in between, so a port clash gets one more try.
    for attempt in range(2):
        try:
            results = _run_two_workers()
            break
        except WorkerFailed as error:
            clash = "Address already in use" in str(error) or "gRPC server" in str(error)
            if not clash or attempt == 1:
                raise
    for result in results:
        assert result["plain_memsave_ops"] == 0 and result["memsave_ops"] > 0, result
        np.testing.assert_allclose(result["memsave"], result["plain"], rtol=1e-5)
        assert result["plain"][-1] < result["plain"][0]
    # The losses are all-reduced, so both workers see the same numbers.
    np.testing.assert_allclose(results[0]["plain"], results[1]["plain"], rtol=1e-6)
