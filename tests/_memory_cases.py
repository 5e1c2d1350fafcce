"""Configurations whose peak memory the tests measure, each in its own process.

Run through memsave.measure.run_isolated("_memory_cases:<name>", ...), which
turns the CPU BFC allocator on before TensorFlow is imported. Every function
returns the peak in MiB of one training-style step and a checksum of the
gradients, so the caller can check the rewrite still computes the same thing.
"""

import numpy as np
import tensorflow as tf

import _models
import memsave
from memsave.measure import device_input, peak_memory_bytes, reserve_one_region


_PREDICTED = {}


def _gradient_fn(mode, marks):
    """tf.gradients or memsave with `mode` ('memory', 'listed', 'budget:F', a strategy;
    'tf+decide:S': tf.gradients, recording as "decided" whether memsave with strategy S
    would rewrite the step, without a process of its own); records the memory model's
    prediction of the step's peak in _PREDICTED."""
    def gradients(ys, xs):
        if mode.startswith("tf"):
            report = memsave.plan(ys, xs, [])
            _PREDICTED["bytes"] = report.baseline_peak_bytes
            _PREDICTED["range"] = report.baseline_peak_range
            _, decide, strategy = mode.partition("+decide:")
            if decide:
                _PREDICTED["decided"] = not memsave.plan(ys, xs, strategy).fallback
            return tf.gradients(ys, xs)
        if mode == "listed":
            checkpoints = marks
        elif mode.startswith("budget:"):
            checkpoints = memsave.budget(float(mode.split(":")[1]))
        else:
            checkpoints = mode
        result = memsave.gradients(ys, xs, checkpoints=checkpoints)
        _PREDICTED["bytes"] = memsave.last_report().predicted_peak_bytes
        _PREDICTED["range"] = memsave.last_report().predicted_peak_range
        _PREDICTED["rewritten"] = not memsave.last_report().fallback
        _PREDICTED["checkpoints"] = len(memsave.last_report().checkpoints)
        return result
    return gradients


# A step's peak depends on the order in which the executor's threads happen to run its
# ops, which changes from call to call (hand-written attention with 'memory', AMD EPYC
# without AVX-512: 10.8 MiB in two calls of twelve, 12.5-13.1 in the others; the bfloat16
# CNN with 'memory', AMD EPYC with AVX-512: 6.5-7.0 MiB in all three calls of two
# processes in five, 8.5-9.5 in every process over eight calls). A training loop meets
# the highest: the peak over this many calls is what the tests measure (as
# benchmarks/compare.py's PREDICT_MEMORY_STEPS).
MEASURED_CALLS = 8


def _peak_over_calls(run):
    """(the peak bytes over MEASURED_CALLS calls of `run`, the last call's result)."""
    def calls():
        result = None
        for _ in range(MEASURED_CALLS):
            result = None  # the last call's outputs are freed before the next call
            result = run()
        return result
    return peak_memory_bytes(calls)


def _predicted_mb():
    """The recorded prediction in MiB: "predicted_mb", and "predicted_range_mb" ([least,
    most], or None: RewriteReport.predicted_peak_range)."""
    peak_range = _PREDICTED.get("range")
    return {"predicted_mb": _PREDICTED.get("bytes", 0) / 2**20,
            "predicted_range_mb": peak_range and [end / 2**20 for end in peak_range]}


def _measure(step, *args):
    step(*args)  # trace and warm up outside the measured calls
    peak, grads = _peak_over_calls(lambda: [g.numpy() for g in step(*args)])
    return {"peak_mb": peak / 2**20, **_predicted_mb(),
            "rewritten": _PREDICTED.get("rewritten", False),
            "decided": _PREDICTED.get("decided"),
            "checkpoints": _PREDICTED.get("checkpoints", 0),
            "checksum": float(sum(np.sum(g, dtype=np.float64) for g in grads))}


def chain(mode, n=100, residual=False, mark_every=10):
    """A chain of n elementwise ops on a 1 MB tensor (a = tanh(a), or a = a + tanh(a))."""
    @tf.function
    def step(x):
        h, marks = x, []
        for i in range(n):
            h = h + tf.tanh(h) if residual else tf.tanh(h)
            if i % mark_every == mark_every - 1 and i < n - 1:
                marks.append(h)
        return _gradient_fn(mode, marks)(tf.reduce_sum(h), [x])

    x = device_input(np.random.RandomState(0).uniform(-1, 1, [512, 512]).astype(np.float32))
    return _measure(step, x)


def deep_mlp(mode, layers=48, batch=2048, width=256, jit=False):
    """A deep tanh MLP with variables, in tf.function (jit=True: compiled by XLA);
    gradients w.r.t. all weights. (At batch 2048 its activations, 96 MiB, still far
    outweigh its weights, 12 MiB; AMD EPYC without AVX-512: tf.gradients 114.8 MiB
    measured / 118.0 predicted, 'memory' 44.5 / 48.8, 0.39x; batch 4096 said the same
    at twice the running time.)"""
    rng = np.random.RandomState(0)
    weights = [tf.Variable((rng.standard_normal([width, width]) / np.sqrt(width)).astype(np.float32))
               for _ in range(layers)]

    @tf.function(jit_compile=jit)
    def step(x):
        h = x
        for w in weights:
            h = tf.tanh(tf.matmul(h, w))
        return _gradient_fn(mode, [])(tf.reduce_mean(h * h), weights)

    x = device_input(rng.standard_normal([batch, width]).astype(np.float32))
    return _measure(step, x)


def silu_mlp(mode, layers=24, batch=2048, width=256):
    """A deep MLP of SiLU (swish) layers in tf.function. `tf.nn.silu` is a
    tf.custom_gradient: its gradient reads its input and recomputes the sigmoid (the
    forward pass's sigmoid and product are never read again)."""
    rng = np.random.RandomState(0)
    # (silu halves small inputs: a gain of 2 keeps the activations, and the gradients,
    # from vanishing over the layers)
    weights = [tf.Variable((2 * rng.standard_normal([width, width]) / np.sqrt(width))
                           .astype(np.float32)) for _ in range(layers)]

    @tf.function
    def step(x):
        h = x
        for w in weights:
            h = tf.nn.silu(tf.matmul(h, w))
        return _gradient_fn(mode, [])(tf.reduce_mean(h * h), weights)

    x = device_input(rng.standard_normal([batch, width]).astype(np.float32))
    return _measure(step, x)


def gelu_mlp(mode, blocks=3, batch=2048, width=256, hidden=1024):
    """Residual blocks of `gelu(h @ w1, approximate=True) @ w2` (keras-hub's GPT-2 MLP)
    in tf.function. The tanh approximation takes `pow(x, 3)`, whose gradient reads its
    output only for the exponent's gradient, which nothing asks for."""
    rng = np.random.RandomState(0)
    pairs = [(tf.Variable((rng.standard_normal([width, hidden]) * 0.05).astype(np.float32)),
              tf.Variable((rng.standard_normal([hidden, width]) * 0.05).astype(np.float32)))
             for _ in range(blocks)]
    weights = [w for pair in pairs for w in pair]

    @tf.function
    def step(x):
        h = x
        for w1, w2 in pairs:
            h = h + tf.matmul(tf.nn.gelu(tf.matmul(h, w1), approximate=True), w2)
        return _gradient_fn(mode, [])(tf.reduce_sum(h * h), weights)

    x = device_input(rng.standard_normal([batch, width]).astype(np.float32))
    return _measure(step, x)


def chain_v1(mode, n=100):
    """The tanh chain of `chain` in a tf.compat.v1 graph, fed through a placeholder."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [512, 512])
        h, marks = x, []
        for i in range(n):
            h = tf.tanh(h)
            if i % 10 == 9 and i < n - 1:
                marks.append(h)
        grads = _gradient_fn(mode, marks)(tf.reduce_sum(h), [x])
        feed = {x: np.random.RandomState(0).uniform(-1, 1, [512, 512]).astype(np.float32)}
        with tf.compat.v1.Session() as session:
            session.run(grads, feed)
            peak, values = _peak_over_calls(lambda: session.run(grads, feed))
    return {"peak_mb": peak / 2**20, **_predicted_mb(),
            "checksum": float(sum(np.sum(g, dtype=np.float64) for g in values))}


def small_cnn(mode, blocks=12, batch=32, width=16, jit=False):
    """A ResNet-style CNN (conv-BN-ReLU blocks from tf.nn ops) in tf.function (jit=True:
    compiled by XLA)."""
    rng = np.random.RandomState(0)

    def variable(shape, scale):
        return tf.Variable((rng.standard_normal(shape) * scale).astype(np.float32))

    stem = variable([3, 3, 3, width], 0.2)
    convs = [(variable([3, 3, width, width], 0.1), variable([width], 0.0) + 1.0,
              variable([width], 0.0)) for _ in range(blocks)]
    weights = [stem] + [v for conv in convs for v in conv[:1]]

    @tf.function(jit_compile=jit)
    def step(images):
        h = tf.nn.relu(tf.nn.conv2d(images, stem, 1, "SAME"))
        for w, scale, offset in convs:
            y = tf.nn.conv2d(h, w, 1, "SAME")
            y, _, _ = tf.compat.v1.nn.fused_batch_norm(y, scale, offset, is_training=True)
            h = tf.nn.relu(h + y)
        return _gradient_fn(mode, [])(tf.reduce_mean(h * h), weights)

    images = device_input(rng.standard_normal([batch, 32, 32, 3]).astype(np.float32))
    return _measure(step, images)


def layer_norm_mlp(mode, blocks=12, rows=2048, width=128, jit=False):
    """Pre-LN residual blocks, x + W2 relu(W1 LN(x)), as in a transformer's feed-forward
    half, in tf.function (jit=True: compiled by XLA). ('memory' against tf.gradients, AMD
    EPYC without AVX-512: 0.33 of XLA's buffers, 0.35 of the peak without XLA; at 4096
    rows 0.30 and 0.31, for 5 s more of the suite.)"""
    rng = np.random.RandomState(0)

    def variable(shape, scale):
        return tf.Variable((rng.standard_normal(shape) * scale).astype(np.float32))

    layers = [(variable([width, 2 * width], 0.05), variable([2 * width, width], 0.05))
              for _ in range(blocks)]
    weights = [w for layer in layers for w in layer]

    @tf.function(jit_compile=jit)
    def step(x):
        h = x
        for w1, w2 in layers:
            mean, var = tf.nn.moments(h, axes=[-1], keepdims=True)
            normed = (h - mean) * tf.math.rsqrt(var + 1e-5)
            h = h + tf.matmul(tf.nn.relu(tf.matmul(normed, w1)), w2)
        return _gradient_fn(mode, [])(tf.reduce_mean(h * h), weights)

    x = device_input(rng.standard_normal([rows, width]).astype(np.float32))
    return _measure(step, x)


def trunk_and_wide_head(mode, defer=True, batch=16, blocks=6, head=3, width=1024, jit=False):
    """A convolutional trunk with large activations and small weights (ReLU blocks at
    64x64x8) under a dense head with large weights and small activations (`head`
    1024x1024 layers), as in a classifier: by the trunk's backward pass the head's
    weight gradients are made. defer=False: the rewrite makes every weight gradient
    where tf.gradients does (memsave.planner.graph.StepGraph.deferred left empty)."""
    if not defer:
        from memsave.planner.graph import StepGraph
        StepGraph._find_deferred = lambda self: None
    seeds = iter(range(1000))

    def normal(shape, scale=1.0):
        # Made by TensorFlow, so the allocator holds it (as device_input's inputs: a
        # tensor converted from a NumPy array is sometimes kept outside it).
        return tf.random.stateless_normal(shape, [next(seeds), 0]) * scale

    def variable(shape, scale):
        return tf.Variable(normal(shape, scale))

    convs = [variable([3, 3, 8, 8], 0.15) for _ in range(blocks)]
    dense = [variable([8, width], 0.3)] + [variable([width, width], 1 / np.sqrt(width))
                                           for _ in range(head)]
    weights = convs + dense

    @tf.function(jit_compile=jit)
    def step(images):
        h = images
        for w in convs:
            h = tf.nn.relu(tf.nn.conv2d(h, w, 1, "SAME"))
        h = tf.reduce_mean(h, axis=[1, 2])
        for w in dense:
            h = tf.tanh(tf.matmul(h, w))
        return _gradient_fn(mode, [])(tf.reduce_mean(h * h), weights)

    return _measure(step, normal([batch, 64, 64, 8]))


def capped(case, limit_mb, **kwargs):
    """`case` run under the CPU allocator's cap of `limit_mb` (the caller sets
    TF_CPU_BFC_MEM_LIMIT_IN_MB to it), the cap reserved first as one region, as a GPU's
    allocator holds its memory; {"oom": True} when the step does not fit."""
    reserve_one_region(limit_mb)
    try:
        return globals()[case](**kwargs)
    except tf.errors.ResourceExhaustedError:
        return {"oom": True}


def one_tensor(nbytes):
    """What TensorFlow's CPU BFC allocator holds, in a fresh process, for one float32
    tensor of `nbytes` made by a kernel; and what memsave's replay of it says."""
    from memsave.planner import allocator

    held = tf.fill([nbytes // 4], 1.0)
    measured = tf.config.experimental.get_memory_info("CPU:0")["current"]
    del held
    simulated, _ = allocator.replayed_peak(allocator.of_device(), [0], [0], [nbytes], [False], 1)
    return {"measured": measured, "simulated": simulated, "allocator": allocator.of_device().name}


def lstm_stack(mode, layers=2, batch=32, steps=60, units=128, features=16):
    """Stacked Keras LSTMs (their loops: while_v2 loops that memsave differentiates
    through recomputing copies) and a dense head, in tf.function."""
    import keras

    keras.utils.set_random_seed(0)
    sequence = keras.Input((steps, features))
    h = sequence
    for layer in range(layers):
        h = keras.layers.LSTM(units, return_sequences=layer < layers - 1)(h)
    net = keras.Model(sequence, keras.layers.Dense(4)(h))
    weights = net.trainable_variables

    @tf.function
    def step(x):
        return _gradient_fn(mode, [])(tf.reduce_mean(net(x) ** 2), weights)

    x = device_input(np.random.RandomState(0).standard_normal([batch, steps, features])
                    .astype(np.float32))
    return _measure(step, x)


def grouped_conv_stack(mode, layers=3, batch=8, size=4, channels=256):
    """Keras grouped (depthwise) 7x7 convolutions, which Keras runs on a CPU as functions
    compiled by XLA; the gradient's program of each holds two dense 7x7 x channels x
    channels filters (24.5 MiB at 256 channels) that no tensor of the graph shows."""
    import keras

    keras.utils.set_random_seed(0)
    image = keras.Input((size, size, channels))
    h = image
    for _ in range(layers):
        h = keras.layers.Conv2D(channels, 7, padding="same", groups=channels)(h)
        h = keras.layers.Activation("gelu")(h)
    net = keras.Model(image, h)
    weights = net.trainable_variables

    @tf.function
    def step(x):
        return _gradient_fn(mode, [])(tf.reduce_mean(net(x) ** 2), weights)

    x = device_input(np.random.RandomState(0).standard_normal([batch, size, size, channels])
                    .astype(np.float32))
    return _measure(step, x)


def keras_gpt(mode, blocks=2, batch=8, seq_len=128, d_model=64, heads=4, vocab=4000):
    """A small GPT from Keras layers in tf.function: an `Embedding` (its gradient sparse),
    causal `MultiHeadAttention` blocks with a GELU MLP, and a vocabulary head (a Dense's
    MatMul and BiasAdd, whose kernel writes into the MatMul's buffer, then the sparse
    cross-entropy, whose kernel writes its backprop into the logits' buffer): the head's
    [batch, seq_len, vocab] logits are the step's largest tensors."""
    net, words, targets = _models.keras_gpt(blocks, batch, seq_len, d_model, heads, vocab)
    weights = net.trainable_variables

    @tf.function
    def step(words, targets):
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            targets, net(words)))
        return [tf.convert_to_tensor(g) for g in _gradient_fn(mode, [])(loss, weights)]

    return _measure(step, device_input(words), device_input(targets))


def scaled_attention(mode, layers=6, batch=8, heads=4, seq_len=128, d_model=64):
    """Attention written by hand, as in the paper: softmax(q k^T / sqrt(d)) v, residual,
    tanh(x w) MLP. Grappler folds the gradient's 1/sqrt(d) into the softmax's output, a
    [batch, heads, seq_len, seq_len] product made in the forward pass and held to the
    gradient (memsave.planner.opinfo.PRODUCT_GRADIENTS)."""
    rng = np.random.RandomState(0)
    head_dim = d_model // heads
    weights = [tf.Variable(rng.standard_normal([d_model, d_model]).astype(np.float32) / 8)
               for _ in range(4 * layers)]

    def split_heads(t):
        return tf.transpose(tf.reshape(t, [batch, seq_len, heads, head_dim]), [0, 2, 1, 3])

    @tf.function
    def step(x):
        h = x
        for layer in range(layers):
            wq, wk, wv, wo = weights[4 * layer:4 * layer + 4]
            q, k, v = (split_heads(tf.einsum("btd,de->bte", h, w)) for w in (wq, wk, wv))
            scores = tf.matmul(q, k, transpose_b=True) / float(np.sqrt(head_dim))
            context = tf.matmul(tf.nn.softmax(scores), v)
            context = tf.reshape(tf.transpose(context, [0, 2, 1, 3]), [batch, seq_len, d_model])
            h = h + tf.tanh(tf.einsum("btd,de->bte", context, wo))
        return _gradient_fn(mode, [])(tf.reduce_sum(h * h), weights)

    x = device_input(rng.standard_normal([batch, seq_len, d_model]).astype(np.float32))
    return _measure(step, x)


def nested_calls(mode, layers=24, batch=2048, width=256, read_outside=False):
    """An MLP whose layers are calls of one nested tf.function (memsave copies a call
    that is recomputed, and builds a call's gradient to see what it holds)."""
    rng = np.random.RandomState(0)
    weights = [tf.Variable(rng.standard_normal([width, width]).astype(np.float32) / 16)
               for _ in range(layers)]

    @tf.function(autograph=False)
    def layer(h, w):
        return tf.tanh(tf.matmul(h, w)) + 0.5 * h

    @tf.function
    def step(x):
        h, marks = x, []
        for i, w in enumerate(weights):
            h = layer(h, tf.identity(w) if read_outside else w)
            if i % 5 == 4:
                marks.append(h)
        return _gradient_fn(mode, marks)(tf.reduce_sum(h * h), weights)

    return _measure(step, device_input(rng.uniform(-1, 1, [batch, width]).astype(np.float32)))


def bfloat16_cnn(mode, blocks=12, batch=32, size=32, channels=16):
    """Keras Conv2D-BatchNorm-ReLU blocks under the `mixed_bfloat16` policy (float32
    weights read through Casts, bfloat16 activations) in tf.function. (At 6 blocks of
    batch 16, where the allocator places a few 0.5 MiB buffers moved the 'memory'
    step's peak by 12% from process to process, AMD EPYC with AVX-512: 8.1-9.0 MiB.)"""
    import keras

    keras.utils.set_random_seed(0)
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        image = keras.Input((size, size, channels))
        h = image
        for _ in range(blocks):
            h = keras.layers.Conv2D(channels, 3, padding="same")(h)
            h = keras.layers.ReLU()(keras.layers.BatchNormalization()(h))
        net = keras.Model(image, keras.layers.Dense(10, dtype="float32")(
            keras.layers.GlobalAveragePooling2D()(h)))
    finally:
        keras.mixed_precision.set_global_policy("float32")
    weights = net.trainable_variables

    @tf.function
    def step(x):
        return _gradient_fn(mode, [])(tf.reduce_mean(net(x, training=True) ** 2), weights)

    x = device_input(np.random.RandomState(0).standard_normal([batch, size, size, channels])
                    .astype(np.float32))
    return _measure(step, x)


def inputs_held(nbytes, conversions=6):
    """What TensorFlow's CPU BFC allocator holds, in a fresh process, after each of
    `conversions` NumPy arrays of `nbytes` is made a step's input by device_input."""
    import gc

    held = []
    for seed in range(conversions):
        before = tf.config.experimental.get_memory_info("CPU:0")["current"]
        x = device_input(np.random.RandomState(seed).standard_normal(nbytes // 4)
                         .astype(np.float32))
        held.append(tf.config.experimental.get_memory_info("CPU:0")["current"] - before)
        del x
        gc.collect()
    return {"held": held}
