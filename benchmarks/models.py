"""Benchmark models: a training step in `tf.function` with a swappable gradient function.

Every builder returns a `BenchModel`: its trainable variables, a batch of synthetic data
(seeded, so every process that builds the same model gets the same weights and data),
and `make_step(grad_fn)`, which wraps "forward pass, loss, `grad_fn(loss, variables)`" in
one `tf.function`. `grad_fn` has `tf.gradients`'s signature, so the same model runs with
`tf.gradients` and with each memsave strategy.

Models (the `--model` flag of compare.py):

- ``cnn`` (default): a ResNet-style CNN for CIFAR-shaped data (32x32x3, 10 classes):
  a 3x3 stem, then `depth` basic residual blocks (conv-BN-ReLU-conv-BN + shortcut, ReLU)
  in three stages of widths w, 2w, 4w at 32, 16 and 8 pixels. depth 27 is ResNet-56;
  the default, 81, has the depth of ResNet-164 (with basic blocks): deep enough that
  activations, not weights, dominate memory, and one step takes about a second.
- ``mlp``: `depth` dense tanh layers of equal width.
- ``calls``: the MLP's layers as calls of one nested `tf.function` (reading its weights
  as variables), as a model built from `tf.function`s runs.
- ``transformer``: token embedding, then `depth` pre-LayerNorm encoder blocks
  (multi-head self-attention and a ReLU MLP, each with a residual), a vocabulary head.
- ``keras``: a `keras.applications` model (ResNet50 by default, MobileNetV2 and others by
  name) with `weights=None` (nothing is downloaded); depth does not apply.
- ``vit``, ``gpt``, ``lstm``: built from Keras layers as users build them: a ViT
  (`MultiHeadAttention` blocks over image patches), a small causal GPT (`Embedding`,
  sparse embedding gradient) and stacked `LSTM`s; depth counts blocks or LSTM layers.

The hand-written models mark every ceil(sqrt(blocks))-th block output with
`memsave.mark_checkpoint`, so `checkpoints='collection'` has something to use; the Keras
model marks nothing. Each traced forward pass also lists its block outputs in
`model.block_outputs`, for explicit checkpoint lists (`every:K` in compare.py).
"""

import contextlib
import math

import numpy as np
import tensorflow as tf

import memsave

MODELS = ("cnn", "mlp", "calls", "transformer", "keras", "vit", "gpt", "gpt2", "lstm", "unet")

# Per-model defaults, sized so one step takes well under a second on 2 CPU cores.
DEFAULTS = {
    "cnn": {"depth": 81, "batch": 32},
    "mlp": {"depth": 36, "batch": 2048},
    "calls": {"depth": 36, "batch": 2048},
    "transformer": {"depth": 8, "batch": 16},
    "keras": {"depth": 0, "batch": 16},
    "vit": {"depth": 8, "batch": 32},
    "gpt": {"depth": 6, "batch": 8},
    "gpt2": {"depth": 6, "batch": 8},
    "lstm": {"depth": 2, "batch": 64},
    "unet": {"depth": 4, "batch": 8},
}


class BenchModel:
    """A model, its data and a way to build its training step with a given gradient function.

    Attributes:
      name: model name, for tables.
      description: one line saying what was built (sizes).
      variables: the trainable `tf.Variable`s, in a fixed order.
      inputs: tuple of numpy arrays, the synthetic batch (features, labels).
      marks_checkpoints: whether the forward pass marks tensors for 'collection'.
      block_outputs: the block outputs of the latest traced forward pass.
    """

    def __init__(self, name, description, variables, inputs, forward, marks_checkpoints):
        self.name = name
        self.description = description
        self.variables = list(variables)
        self.inputs = inputs
        self._forward = forward
        self.marks_checkpoints = marks_checkpoints
        self.block_outputs = []

    def loss(self, *inputs):
        """The forward pass and loss (call while tracing); refreshes `block_outputs`."""
        self.block_outputs = []
        return self._forward(self, *inputs)

    def make_step(self, grad_fn, jit_compile=False):
        """A `tf.function` step(features, labels) -> (loss, gradients).

        `grad_fn(ys, xs)` is called once per trace with the loss and the variables;
        where it has a `tape` attribute (a callable making a GradientTape), the forward
        pass is recorded on that tape instead and `grad_fn.gradient(tape, loss, xs)`
        takes the gradients; its `context` attribute, where it has one, is entered around
        the whole step (memsave.patch). jit_compile=True compiles the step with XLA.
        """
        variables = self.variables
        make_tape = getattr(grad_fn, "tape", None)
        context = getattr(grad_fn, "context", contextlib.nullcontext)

        def step(*inputs):
            with context():
                if make_tape is None:
                    loss = self.loss(*inputs)
                    grads = grad_fn(loss, variables)
                else:
                    with make_tape() as tape:
                        loss = self.loss(*inputs)
                    grads = grad_fn.gradient(tape, loss, variables)
            return loss, list(grads)

        return tf.function(step, autograph=False, jit_compile=jit_compile)

    def num_parameters(self):
        return int(sum(np.prod(v.shape) for v in self.variables))


def _mark_every(model, tensor, index, every):
    model.block_outputs.append(tensor)
    if every and (index + 1) % every == 0:
        memsave.mark_checkpoint(tensor)
    return tensor


def _sqrt_spacing(blocks):
    return max(1, int(math.ceil(math.sqrt(blocks))))


class _Init:
    """Seeded numpy initialisers, so weights are identical in every process."""

    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)
        self.count = 0

    def variable(self, shape, fan_in=None, scale=None, value=None, name="w"):
        self.count += 1
        if value is not None:
            array = np.full(shape, value, dtype=np.float32)
        else:
            std = scale if scale is not None else math.sqrt(2.0 / fan_in)
            array = (self.rng.standard_normal(shape) * std).astype(np.float32)
        return tf.Variable(array, name=f"{name}_{self.count}")


# ----------------------------------------------------------------------------- cnn

def build_cnn(depth=81, batch=32, seed=0, width=16, image_size=32, classes=10):
    """ResNet-style CNN on synthetic CIFAR-shaped data; `depth` residual blocks."""
    if depth < 1:
        raise ValueError(f"cnn needs depth >= 1 residual blocks, got {depth}")
    init = _Init(seed)
    per_stage = [depth // 3 + (1 if i < depth % 3 else 0) for i in range(3)]
    every = _sqrt_spacing(depth)

    def conv_params(k, cin, cout):
        return {"w": init.variable([k, k, cin, cout], fan_in=k * k * cin, name="conv"),
                "scale": init.variable([cout], value=1.0, name="bn_scale"),
                "offset": init.variable([cout], value=0.0, name="bn_offset")}

    stem = conv_params(3, 3, width)
    blocks = []
    cin = width
    for stage, count in enumerate(per_stage):
        cout = width * 2 ** stage
        for i in range(count):
            stride = 2 if (stage > 0 and i == 0) else 1
            block = {"stride": stride, "a": conv_params(3, cin, cout), "b": conv_params(3, cout, cout)}
            if stride != 1 or cin != cout:
                block["proj"] = conv_params(1, cin, cout)
            blocks.append(block)
            cin = cout
    head_w = init.variable([cin, classes], fan_in=cin, name="fc")
    head_b = init.variable([classes], value=0.0, name="fc_b")

    variables = []
    for params in [stem] + [p for b in blocks for p in (b["a"], b["b"], b.get("proj")) if p]:
        variables += [params["w"], params["scale"], params["offset"]]
    variables += [head_w, head_b]

    def conv_bn(x, params, stride=1, relu=True):
        y = tf.nn.conv2d(x, params["w"], strides=stride, padding="SAME")
        y, _, _ = tf.compat.v1.nn.fused_batch_norm(y, params["scale"], params["offset"],
                                                  epsilon=1e-5, is_training=True)
        return tf.nn.relu(y) if relu else y

    def forward(model, images, labels):
        x = conv_bn(images, stem)
        for index, block in enumerate(blocks):
            shortcut = conv_bn(x, block["proj"], block["stride"], relu=False) if "proj" in block else x
            y = conv_bn(x, block["a"], block["stride"])
            y = conv_bn(y, block["b"], relu=False)
            x = _mark_every(model, tf.nn.relu(y + shortcut), index, every)
        pooled = tf.reduce_mean(x, axis=[1, 2])
        logits = tf.matmul(pooled, head_w) + head_b
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels,
                                                                             logits=logits))

    rng = np.random.default_rng(seed + 1)
    images = rng.standard_normal([batch, image_size, image_size, 3]).astype(np.float32)
    labels = rng.integers(0, classes, size=[batch]).astype(np.int32)
    description = (f"ResNet-style CNN: {depth} residual blocks (ResNet-{2 * depth + 2}), "
                   f"stages {per_stage}, width {width}, input {batch}x{image_size}x{image_size}x3")
    return BenchModel("cnn", description, variables, (images, labels), forward, True)


# ----------------------------------------------------------------------------- mlp

def build_mlp(depth=36, batch=2048, seed=0, width=256, classes=10):
    """`depth` dense tanh layers of `width` units on synthetic features."""
    return _dense_tanh_layers("mlp", lambda x, w, b: tf.tanh(tf.matmul(x, w) + b), depth,
                              batch, seed, width, classes,
                              f"MLP: {depth} tanh layers of width {width}, batch {batch}")


def build_calls(depth=36, batch=2048, seed=0, width=256, classes=10):
    """The MLP's `depth` layers, each a call of one nested tf.function that reads its
    weights as variables (a StatefulPartitionedCall, which TensorFlow inlines before the
    step runs)."""
    layer = tf.function(lambda x, w, b: tf.tanh(tf.matmul(x, w) + b), autograph=False)
    return _dense_tanh_layers("calls", layer, depth, batch, seed, width, classes,
                              f"nested calls: {depth} calls of a tf.function tanh layer of "
                              f"width {width}, batch {batch}")


def _dense_tanh_layers(name, layer, depth, batch, seed, width, classes, description):
    """`depth` layers `layer(x, w, b)` of `width` units, a softmax head, synthetic data."""
    if depth < 1:
        raise ValueError(f"{name} needs depth >= 1 layers, got {depth}")
    init = _Init(seed)
    every = _sqrt_spacing(depth)
    layers = [(init.variable([width, width], scale=1.0 / math.sqrt(width), name="dense"),
               init.variable([width], value=0.0, name="bias")) for _ in range(depth)]
    head_w = init.variable([width, classes], fan_in=width, name="fc")
    variables = [v for pair in layers for v in pair] + [head_w]

    def forward(model, features, labels):
        x = features
        for index, (w, b) in enumerate(layers):
            x = _mark_every(model, layer(x, w, b), index, every)
        logits = tf.matmul(x, head_w)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels,
                                                                             logits=logits))

    rng = np.random.default_rng(seed + 1)
    features = rng.standard_normal([batch, width]).astype(np.float32)
    labels = rng.integers(0, classes, size=[batch]).astype(np.int32)
    return BenchModel(name, description, variables, (features, labels), forward, True)


# ----------------------------------------------------------------------------- transformer

def build_transformer(depth=8, batch=16, seed=0, seq_len=128, d_model=128, heads=4,
                      d_ff=512, vocab=1000):
    """Token embedding plus `depth` pre-LN encoder blocks and a vocabulary head."""
    if depth < 1:
        raise ValueError(f"transformer needs depth >= 1 blocks, got {depth}")
    if d_model % heads:
        raise ValueError(f"d_model {d_model} is not divisible by heads {heads}")
    init = _Init(seed)
    every = _sqrt_spacing(depth)
    head_dim = d_model // heads
    embedding = init.variable([vocab, d_model], scale=0.02, name="embedding")
    blocks = []
    for _ in range(depth):
        blocks.append({
            "ln1_g": init.variable([d_model], value=1.0, name="ln_g"),
            "ln1_b": init.variable([d_model], value=0.0, name="ln_b"),
            "qkv": init.variable([d_model, 3 * d_model], fan_in=d_model, name="qkv"),
            "out": init.variable([d_model, d_model], fan_in=d_model, name="attn_out"),
            "ln2_g": init.variable([d_model], value=1.0, name="ln_g"),
            "ln2_b": init.variable([d_model], value=0.0, name="ln_b"),
            "ff1": init.variable([d_model, d_ff], fan_in=d_model, name="ff1"),
            "ff1_b": init.variable([d_ff], value=0.0, name="ff1_b"),
            "ff2": init.variable([d_ff, d_model], fan_in=d_ff, name="ff2"),
            "ff2_b": init.variable([d_model], value=0.0, name="ff2_b"),
        })
    final_g = init.variable([d_model], value=1.0, name="ln_g")
    final_b = init.variable([d_model], value=0.0, name="ln_b")
    head_w = init.variable([d_model, vocab], fan_in=d_model, name="head")
    variables = [embedding] + [block[k] for block in blocks for k in sorted(block)]
    variables += [final_g, final_b, head_w]

    def layer_norm(x, gain, bias):
        mean, var = tf.nn.moments(x, axes=[-1], keepdims=True)
        return (x - mean) * tf.math.rsqrt(var + 1e-5) * gain + bias

    def dense(x, w, b=None):
        y = tf.einsum("btd,de->bte", x, w)
        return y + b if b is not None else y

    def attention(x, block):
        qkv = dense(x, block["qkv"])
        qkv = tf.reshape(qkv, [batch, seq_len, 3, heads, head_dim])
        q, k, v = tf.unstack(tf.transpose(qkv, [2, 0, 3, 1, 4]))  # each [b, h, t, d]
        scores = tf.matmul(q, k, transpose_b=True) / math.sqrt(head_dim)
        context = tf.matmul(tf.nn.softmax(scores), v)
        context = tf.reshape(tf.transpose(context, [0, 2, 1, 3]), [batch, seq_len, d_model])
        return dense(context, block["out"])

    def forward(model, tokens, targets):
        x = tf.gather(embedding, tokens)
        for index, block in enumerate(blocks):
            x = x + attention(layer_norm(x, block["ln1_g"], block["ln1_b"]), block)
            h = tf.nn.relu(dense(layer_norm(x, block["ln2_g"], block["ln2_b"]),
                                 block["ff1"], block["ff1_b"]))
            x = _mark_every(model, x + dense(h, block["ff2"], block["ff2_b"]), index, every)
        logits = dense(layer_norm(x, final_g, final_b), head_w)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=targets,
                                                                             logits=logits))

    rng = np.random.default_rng(seed + 1)
    tokens = rng.integers(0, vocab, size=[batch, seq_len]).astype(np.int32)
    targets = np.roll(tokens, -1, axis=1)
    description = (f"Transformer encoder: {depth} blocks, d_model {d_model}, {heads} heads, "
                   f"d_ff {d_ff}, sequence {seq_len}, batch {batch}, vocabulary {vocab}")
    return BenchModel("transformer", description, variables, (tokens, targets), forward, True)


# ----------------------------------------------------------------------------- keras

def build_keras(depth=0, batch=16, seed=0, app="ResNet50", image_size=64, classes=10,
                remat=None, mixed_precision=None):
    """A `keras.applications` model with random weights (`weights=None`, no download).

    `depth` is ignored (the application fixes it). Only the model's own forward pass
    runs inside the step, with `training=True` (batch norm uses batch statistics).
    `remat`: build it inside `keras.RematScope(mode=remat)` (Keras 3.9+).
    `mixed_precision`: 'float16' or 'bfloat16' builds it under Keras' `mixed_<that>`
    dtype policy (2-byte activations, float32 weights); the loss is taken in float32.
    """
    import keras

    keras.utils.set_random_seed(seed)
    try:
        constructor = getattr(keras.applications, app)
    except AttributeError:
        raise ValueError(f"keras.applications has no model {app!r}; try ResNet50, "
                         f"MobileNetV2, DenseNet121") from None
    with _keras_scope(remat, mixed_precision):
        net = constructor(weights=None, input_shape=(image_size, image_size, 3), classes=classes)

    def loss_of(probabilities, labels):
        picked = tf.reduce_sum(probabilities * tf.one_hot(labels, classes), axis=-1)
        return -tf.reduce_mean(tf.math.log(picked + 1e-7))

    rng = np.random.default_rng(seed + 1)
    images = rng.standard_normal([batch, image_size, image_size, 3]).astype(np.float32)
    labels = rng.integers(0, classes, size=[batch]).astype(np.int32)
    description = (f"keras.applications.{app}(weights=None): {len(net.layers)} layers, "
                   f"input {batch}x{image_size}x{image_size}x3" + _policy_note(mixed_precision))
    return _keras_layer_model("keras", net, (images, labels), description, loss_of)


# ----------------------------------------------------------------------------- Keras-layer models
# Built from Keras layers as users build them (MultiHeadAttention, Embedding, LSTM), so
# memsave and keras.RematScope see what a Keras user's graph holds.

def _keras_layer_model(name, net, inputs, description, loss_of):
    """A BenchModel whose forward pass is `loss_of(net(features, training=True), labels)`,
    the network's output taken in float32 (under a mixed-precision policy it is not)."""
    variables = [v.value if hasattr(v, "value") else v for v in net.trainable_variables]

    def forward(model, features, labels):
        return loss_of(tf.cast(net(features, training=True), tf.float32), labels)

    model = BenchModel(name, description, variables, inputs, forward, False)
    model.keras_model = net
    return model


MIXED_PRECISION = ("float16", "bfloat16")


@contextlib.contextmanager
def _keras_scope(remat=None, mixed_precision=None):
    """Builds Keras layers inside `keras.RematScope(mode=remat)` and under the
    `mixed_<mixed_precision>` dtype policy, Keras' global policy as it was on exit."""
    import keras

    if mixed_precision not in (None,) + MIXED_PRECISION:
        raise ValueError(f"mixed_precision={mixed_precision!r}; use one of "
                         f"{', '.join(MIXED_PRECISION)}")
    with _global_dtype_policy(f"mixed_{mixed_precision}" if mixed_precision else None):
        with keras.RematScope(mode=remat) if remat else contextlib.nullcontext():
            yield


@contextlib.contextmanager
def _global_dtype_policy(name):
    """Keras' global dtype policy set to `name` (None: left alone), restored on exit to
    what it was, unset included: reading it with keras.config.dtype_policy() would fix it
    at the float type of that moment, and a later keras.config.set_floatx would not apply."""
    if name is None:
        yield
        return
    import keras
    from keras.src.backend.common import global_state

    previous = global_state.get_global_attribute("dtype_policy", None)
    keras.config.set_dtype_policy(name)
    try:
        yield
    finally:
        global_state.set_global_attribute("dtype_policy", previous)


def _policy_note(mixed_precision):
    return f", mixed_{mixed_precision}" if mixed_precision else ""


def _sparse_cross_entropy(logits, labels):
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits))


def _encoder_block(keras, x, d_model, heads, causal=False):
    """Pre-LayerNorm block: x + MHA(LN(x)), then x + MLP(LN(x)) (GELU, 4 d_model)."""
    normed = keras.layers.LayerNormalization(epsilon=1e-6)(x)
    attended = keras.layers.MultiHeadAttention(heads, d_model // heads)(
        normed, normed, use_causal_mask=causal)
    x = keras.layers.Add()([x, attended])
    normed = keras.layers.LayerNormalization(epsilon=1e-6)(x)
    hidden = keras.layers.Dense(4 * d_model, activation="gelu")(normed)
    return keras.layers.Add()([x, keras.layers.Dense(d_model)(hidden)])


def _position_layer(keras, length, d_model):
    """Adds a learned position embedding to a [batch, length, d_model] input."""

    class AddPosition(keras.layers.Layer):
        def build(self, input_shape):
            self.position = self.add_weight(shape=(length, d_model), name="position",
                                            initializer="random_normal")

        def call(self, x):
            return x + self.position

    return AddPosition()


def build_vit(depth=8, batch=32, seed=0, image_size=64, patch=8, d_model=192, heads=3,
              classes=10, remat=None, mixed_precision=None):
    """A ViT from Keras layers: patches by a strided Conv2D, a learned position embedding,
    `depth` pre-LayerNorm blocks of `keras.layers.MultiHeadAttention` and a GELU MLP,
    mean-pooled tokens and a softmax head."""
    import keras

    keras.utils.set_random_seed(seed)
    tokens = (image_size // patch) ** 2
    with _keras_scope(remat, mixed_precision):
        images = keras.Input((image_size, image_size, 3))
        x = keras.layers.Conv2D(d_model, patch, strides=patch)(images)
        x = _position_layer(keras, tokens, d_model)(keras.layers.Reshape((tokens, d_model))(x))
        for _ in range(depth):
            x = _encoder_block(keras, x, d_model, heads)
        x = keras.layers.GlobalAveragePooling1D()(keras.layers.LayerNormalization()(x))
        net = keras.Model(images, keras.layers.Dense(classes)(x))
    rng = np.random.default_rng(seed + 1)
    inputs = (rng.standard_normal([batch, image_size, image_size, 3]).astype(np.float32),
              rng.integers(0, classes, size=[batch]).astype(np.int32))
    description = (f"ViT (Keras layers): {depth} blocks, d {d_model}, {heads} heads, "
                   f"{image_size} px, patch {patch}, batch {batch}" + _policy_note(mixed_precision))
    return _keras_layer_model("vit", net, inputs, description, _sparse_cross_entropy)


def build_gpt(depth=6, batch=8, seed=0, seq_len=256, d_model=256, heads=8, vocab=8000,
              remat=None, mixed_precision=None):
    """A small GPT from Keras layers: `keras.layers.Embedding` tokens and a learned position
    embedding, `depth` causal pre-LayerNorm blocks, a vocabulary head; next-token loss.
    The embedding's gradient is sparse (IndexedSlices) under tf.gradients."""
    import keras

    keras.utils.set_random_seed(seed)
    with _keras_scope(remat, mixed_precision):
        tokens = keras.Input((seq_len,), dtype="int32")
        x = keras.layers.Embedding(vocab, d_model)(tokens)
        x = _position_layer(keras, seq_len, d_model)(x)
        for _ in range(depth):
            x = _encoder_block(keras, x, d_model, heads, causal=True)
        x = keras.layers.LayerNormalization(epsilon=1e-6)(x)
        net = keras.Model(tokens, keras.layers.Dense(vocab)(x))
    rng = np.random.default_rng(seed + 1)
    words = rng.integers(0, vocab, size=[batch, seq_len]).astype(np.int32)
    description = (f"GPT (Keras layers): {depth} causal blocks, d {d_model}, {heads} heads, "
                   f"sequence {seq_len}, vocabulary {vocab}, batch {batch}" + _policy_note(mixed_precision))
    return _keras_layer_model("gpt", net, (words, np.roll(words, -1, axis=1)), description,
                              _sparse_cross_entropy)


def build_gpt2(depth=6, batch=8, seed=0, seq_len=256, d_model=256, heads=4, vocab=8000,
               remat=None, mixed_precision=None):
    """keras-hub's GPT2CausalLM built from arguments (no weights, no download; needs
    `pip install keras-hub`): `depth` layers, GPT-2's dropout of 0.1 (stateless, seeded:
    a recomputation gives the same values), the logits from the tied token embedding;
    next-token loss over every position."""
    import keras
    try:
        import keras_hub
    except ImportError as missing:
        raise ImportError("--model gpt2 builds keras-hub's GPT2CausalLM: pip install keras-hub "
                          f"({missing})") from missing

    keras.utils.set_random_seed(seed)
    with _keras_scope(remat, mixed_precision):
        backbone = keras_hub.models.GPT2Backbone(
            vocabulary_size=vocab, num_layers=depth, num_heads=heads, hidden_dim=d_model,
            intermediate_dim=4 * d_model, max_sequence_length=seq_len)
        causal_lm = keras_hub.models.GPT2CausalLM(backbone, preprocessor=None)
        tokens = keras.Input((seq_len,), dtype="int32")
        logits = causal_lm({"token_ids": tokens,
                            "padding_mask": keras.ops.ones_like(tokens, dtype="bool")})
        net = keras.Model(tokens, logits)
    rng = np.random.default_rng(seed + 1)
    words = rng.integers(0, vocab, size=[batch, seq_len]).astype(np.int32)
    description = (f"keras-hub GPT2CausalLM: {depth} layers, d {d_model}, {heads} heads, "
                   f"sequence {seq_len}, vocabulary {vocab}, batch {batch}"
                   + _policy_note(mixed_precision))
    return _keras_layer_model("gpt2", net, (words, np.roll(words, -1, axis=1)), description,
                              _sparse_cross_entropy)


def build_unet(depth=4, batch=8, seed=0, image_size=128, base=16, classes=4, remat=None,
               mixed_precision=None):
    """A Keras functional U-Net for segmentation: `depth` levels down (conv-BN-ReLU twice,
    then a 2x2 max pool) and up (a 2x2 transposed convolution, concatenated with the
    level's skip, conv-BN-ReLU twice), `base` filters doubling per level, a 1x1
    convolution to per-pixel class logits."""
    import keras

    def conv_block(x, filters):
        for _ in range(2):
            x = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False)(x)
            x = keras.layers.ReLU()(keras.layers.BatchNormalization()(x))
        return x

    keras.utils.set_random_seed(seed)
    with _keras_scope(remat, mixed_precision):
        images = keras.Input((image_size, image_size, 3))
        x, skips = images, []
        for level in range(depth):
            x = conv_block(x, base * 2 ** level)
            skips.append(x)
            x = keras.layers.MaxPooling2D()(x)
        x = conv_block(x, base * 2 ** depth)
        for level in reversed(range(depth)):
            x = keras.layers.Conv2DTranspose(base * 2 ** level, 2, strides=2)(x)
            x = conv_block(keras.layers.Concatenate()([x, skips[level]]), base * 2 ** level)
        net = keras.Model(images, keras.layers.Conv2D(classes, 1, dtype="float32")(x))
    rng = np.random.default_rng(seed + 1)
    inputs = (rng.standard_normal([batch, image_size, image_size, 3]).astype(np.float32),
              rng.integers(0, classes, size=[batch, image_size, image_size]).astype(np.int32))
    description = (f"U-Net (Keras layers): {depth} levels, {base} base filters, "
                   f"{image_size} px, batch {batch}" + _policy_note(mixed_precision))
    return _keras_layer_model("unet", net, inputs, description, _sparse_cross_entropy)


def build_lstm(depth=2, batch=64, seed=0, seq_len=100, units=256, features=32, classes=10,
               remat=None, mixed_precision=None):
    """`depth` stacked `keras.layers.LSTM(units)` over a float sequence, a softmax head on
    the last step's output."""
    import keras

    keras.utils.set_random_seed(seed)
    with _keras_scope(remat, mixed_precision):
        sequence = keras.Input((seq_len, features))
        x = sequence
        for layer in range(depth):
            x = keras.layers.LSTM(units, return_sequences=layer < depth - 1)(x)
        net = keras.Model(sequence, keras.layers.Dense(classes)(x))
    rng = np.random.default_rng(seed + 1)
    inputs = (rng.standard_normal([batch, seq_len, features]).astype(np.float32),
              rng.integers(0, classes, size=[batch]).astype(np.int32))
    description = (f"{depth} stacked Keras LSTM({units}), sequence {seq_len}, "
                   f"{features} features, batch {batch}" + _policy_note(mixed_precision))
    return _keras_layer_model("lstm", net, inputs, description, _sparse_cross_entropy)


BUILDERS = {"cnn": build_cnn, "mlp": build_mlp, "calls": build_calls,
            "transformer": build_transformer,
            "keras": build_keras, "vit": build_vit, "gpt": build_gpt, "gpt2": build_gpt2,
            "lstm": build_lstm, "unet": build_unet}
# Models built from Keras layers (keras.RematScope applies to them).
KERAS_MODELS = ("keras", "vit", "gpt", "gpt2", "lstm", "unet")


def build_model(name, depth=None, batch=None, seed=0, **options):
    """Builds model `name` (one of MODELS); None depth/batch take the model's default."""
    if name not in BUILDERS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    defaults = DEFAULTS[name]
    return BUILDERS[name](depth=defaults["depth"] if depth is None else depth,
                          batch=defaults["batch"] if batch is None else batch,
                          seed=seed, **options)
