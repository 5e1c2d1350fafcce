"""Small models shared by the rewrite tests and the isolated memory cases.

Each builder runs inside a graph (a tf.compat.v1 Graph or a tf.function body),
creates what it needs (variables from fixed numpy seeds) and returns
`(ys, xs, extras)`, where extras may hold `grad_ys` and marked checkpoints.
"""

import numpy as np
import tensorflow as tf

import memsave


def _const(shape, seed, scale=1.0):
    return tf.constant((np.random.RandomState(seed).standard_normal(shape) * scale).astype(np.float32))


def tanh_mlp_loss(x, weights):
    """sum(h * h) of h = tanh(... tanh(x @ w0) ... @ wn): a step many tests share."""
    h = x
    for w in weights:
        h = tf.tanh(tf.matmul(h, w))
    return tf.reduce_sum(h * h)


def language_model_head(vocab=512, blocks=4):
    """A float64 stack of tanh Dense layers, then a vocabulary head and a sparse softmax
    cross-entropy over it (a language model's last segment: its largest ops); returns
    the loss, the xs (the weights' reads), each block's output and the head's logits."""
    rng = np.random.RandomState(3)
    h = tf.constant(rng.standard_normal([64, 32]))
    xs, outs = [], []
    for _ in range(blocks):
        w = tf.convert_to_tensor(tf.Variable(rng.standard_normal([32, 32]) * 0.3))
        xs.append(w)
        h = tf.tanh(tf.matmul(h, w))
        outs.append(h)
    head = tf.convert_to_tensor(tf.Variable(rng.standard_normal([32, vocab]) * 0.3))
    xs.append(head)
    logits = tf.matmul(h, head)
    losses = tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=tf.constant(rng.randint(0, vocab, [64])), logits=logits)
    return tf.reduce_sum(losses), xs, outs, logits



def keras_gpt(blocks=2, batch=8, seq_len=128, d_model=64, heads=4, vocab=4000):
    """A small GPT from Keras layers (an `Embedding`, causal `MultiHeadAttention` blocks
    with a GELU MLP, a vocabulary head), and a batch of tokens and their next tokens for
    it (int32 arrays): (model, words, targets)."""
    import keras

    keras.utils.set_random_seed(0)
    tokens = keras.Input((seq_len,), dtype="int32")
    x = keras.layers.Embedding(vocab, d_model)(tokens)
    for _ in range(blocks):
        normed = keras.layers.LayerNormalization()(x)
        x = x + keras.layers.MultiHeadAttention(heads, d_model // heads)(
            normed, normed, use_causal_mask=True)
        hidden = keras.layers.Dense(4 * d_model, activation="gelu")(
            keras.layers.LayerNormalization()(x))
        x = x + keras.layers.Dense(d_model)(hidden)
    net = keras.Model(tokens, keras.layers.Dense(vocab)(keras.layers.LayerNormalization()(x)))
    words = np.random.RandomState(0).randint(0, vocab, [batch, seq_len]).astype(np.int32)
    return net, words, np.roll(words, -1, axis=1)

_VARIABLES = {}


def reset_variables():
    """Forgets the variables made so far (call before building a new model)."""
    _VARIABLES.clear()


def _var(shape, seed, scale):
    # tf.function traces a body that creates variables twice; the second trace must
    # get the same variables back, so variables are remembered until reset.
    key = (tuple(shape), seed, scale)
    if key not in _VARIABLES:
        _VARIABLES[key] = tf.Variable(
            (np.random.RandomState(seed).standard_normal(shape) * scale).astype(np.float32))
    return _VARIABLES[key]


def tanh_chain(n=20, width=32):
    x = _const([8, width], 0)
    h = x
    for i in range(n):
        h = tf.tanh(h * 1.1 + 0.1)
        if i % 5 == 4:
            memsave.mark_checkpoint(h)
    return [tf.reduce_sum(h * h)], [x], {}


def resnet_chain(n=20, width=32):
    x = _const([8, width], 1, 0.5)
    h = x
    for i in range(n):
        h = h + tf.tanh(h) * 0.5
        if i % 5 == 4:
            memsave.mark_checkpoint(h)
    return [tf.reduce_mean(h * h)], [x], {}


def deep_mlp(n=8, width=32, batch=16):
    x = _const([batch, width], 2)
    weights = [_var([width, width], 10 + i, 1.0 / np.sqrt(width)) for i in range(n)]
    biases = [_var([width], 50 + i, 0.1) for i in range(n)]
    h = x
    for i, (w, b) in enumerate(zip(weights, biases)):
        h = tf.tanh(tf.matmul(h, w) + b)
        if i % 3 == 2:
            memsave.mark_checkpoint(h)
    return [tf.reduce_mean(h * h)], weights + biases, {}


def small_cnn(blocks=3, channels=8):
    x = _const([4, 12, 12, 3], 3)
    kernels = [_var([3, 3, 3 if i == 0 else channels, channels], 20 + i, 0.3) for i in range(blocks)]
    scales = [_var([channels], 60 + i, 0.1) for i in range(blocks)]
    h = x
    for i, (k, s) in enumerate(zip(kernels, scales)):
        h = tf.nn.conv2d(h, k, strides=1, padding="SAME")
        mean, variance = tf.nn.moments(h, axes=[0, 1, 2])
        h = tf.nn.batch_normalization(h, mean, variance, offset=s, scale=None, variance_epsilon=1e-3)
        h = memsave.mark_checkpoint(tf.nn.relu(h))
    return [tf.reduce_mean(h)], kernels + scales, {}


@tf.custom_gradient
def _tanh_with_own_gradient(v):
    def gradient(dy):
        return dy * (1.0 - tf.square(tf.tanh(v)))  # reads v, the forward pass's input
    return tf.tanh(v), gradient


def swish_mlp(n=8, width=32):
    """Custom gradients (tf.custom_gradient: closures that read forward tensors):
    tf.nn.silu's and one of this file's own."""
    x = _const([16, width], 8)
    weights = [_var([width, width], 70 + i, 1.5 / np.sqrt(width)) for i in range(n)]
    h = x
    for i, w in enumerate(weights):
        activation = tf.nn.silu if i % 2 == 0 else _tanh_with_own_gradient
        h = activation(tf.matmul(h, w))
        if i % 3 == 2:
            memsave.mark_checkpoint(h)
    return [tf.reduce_mean(h * h)], weights, {}


def multiple_ys(n=12, width=16):
    ys, xs, extras = tanh_chain(n, width)
    h = ys[0].op.inputs[0]
    return [ys[0], tf.reduce_sum(tf.sin(h))], xs, extras


def with_grad_ys(n=12, width=16):
    x = _const([4, width], 4)
    h = x
    for _ in range(n):
        h = tf.tanh(h + 0.2)
    return [h], [x], {"grad_ys": [_const([4, width], 5)]}


def intermediate_xs(n=12, width=16):
    x = _const([4, width], 6)
    hs, h = [], x
    for _ in range(n):
        h = tf.sin(h) + h
        hs.append(h)
    return [tf.reduce_sum(h)], [hs[2], hs[6], x], {}


def unconnected_xs(n=10, width=16):
    ys, xs, extras = tanh_chain(n, width)
    return ys, xs + [_const([3], 7)], extras


MODELS = {
    "tanh_chain": tanh_chain, "resnet_chain": resnet_chain, "deep_mlp": deep_mlp,
    "small_cnn": small_cnn, "swish_mlp": swish_mlp, "multiple_ys": multiple_ys, "grad_ys": with_grad_ys,
    "intermediate_xs": intermediate_xs, "unconnected_xs": unconnected_xs,
}


def both_gradients(model, checkpoints):
    """Builds `model` and returns (tf.gradients result, memsave result) in the current graph."""
    ys, xs, extras = MODELS[model]()
    if checkpoints == "every_third":
        checkpoints = _every_third_op_output(ys, xs)
    grad_ys = extras.get("grad_ys")
    expected = tf.gradients(ys, xs, grad_ys=grad_ys)
    got = memsave.gradients(ys, xs, grad_ys=grad_ys, checkpoints=checkpoints)
    return expected, got


def _every_third_op_output(ys, xs):
    from memsave.inputs import normalise_call
    from memsave.region import ForwardRegion
    call = normalise_call(ys, xs)
    region = ForwardRegion.build(call.ys, call.xs)
    return [op.outputs[0] for op in region.ops[::3] if op.outputs]
