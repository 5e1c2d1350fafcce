"""What Keras `fit` runs its steps with: the batch, read from what `fit` is given,
and the optimizer's state held beside the gradients (`optimizer_state`, memsave.beside).

Keras 3 (`keras`) and Keras 2 (`tf_keras`) both trace their train function with a batch
of None; memsave plans that step for the batch found here (see memsave.batch), per
replica under a distribution strategy:

- arrays (NumPy, tensors, nests of them): `batch_size`, Keras' default 32, or the
  number of examples where that is fewer;
- a `tf.data.Dataset`: its element_spec's batch where that is static, else the
  leading dimension of its first element (read once, from an iterator of its own,
  before `fit` starts; only where `fit` will trace its step);
- a `keras.utils.PyDataset` (Keras 2: a `tf_keras.utils.Sequence`): its first batch,
  `x[0]`;
- anything else (a Python generator): unknown, since reading it would consume it.

Imports Keras 3 (which TensorFlow installs); reads `tf_keras` only where the program
has imported it. Loaded by memsave.keras and by memsave.patch where Keras is in use.
"""

import contextlib
import functools
import inspect
import logging
import math
import sys

import keras
import tensorflow as tf

from memsave import batch as batch_lib
from memsave import beside as beside_lib

_log = logging.getLogger(__name__)

KERAS_DEFAULT_BATCH = 32
# Temporaries of an optimizer's update of one weight, in its gradient's bytes (optimizer_state).
UPDATE_TEMPORARIES = 2


def _keras_2():
    """The tf_keras module where the program imported it (memsave never imports it)."""
    return sys.modules.get("tf_keras")


def _leading_dim(structure):
    """The leading dimension of the first array-like leaf of `structure`, or None."""
    for leaf in tf.nest.flatten(structure):
        shape = getattr(leaf, "shape", None)
        if shape is None:
            continue
        dims = list(shape) if not isinstance(shape, tf.TensorShape) else shape.as_list()
        if dims and dims[0] is not None:
            return int(dims[0])
    return None


def _dataset_batch(dataset):
    specs = [s for s in tf.nest.flatten(dataset.element_spec) if isinstance(s, tf.TensorSpec)]
    static = _leading_dim(specs)
    if static is not None:
        return static, "the dataset's element_spec"
    for first in dataset.take(1):
        found = _leading_dim(first)
        return (found, "the dataset's first batch") if found else None
    return None


def fit_batch_size(x=None, batch_size=None, validation_split=0.0):
    """(batch, source) for the steps `fit(x, batch_size=...)` runs, or None where it
    cannot be told without consuming data.

    Args:
      x, batch_size, validation_split: as given to `fit`.
    Returns:
      (int, str): the batch and where it came from, for the report; or None.
    """
    if isinstance(x, tf.data.Dataset):
        return _dataset_batch(x)
    indexed = [kind for kind in _indexed_batch_types() if isinstance(x, kind)]
    if indexed:
        found = _leading_dim(x[0])
        return (found, f"the {indexed[0].__name__}'s first batch") if found else None
    examples = _leading_dim(x)
    if examples is None:
        return None
    examples = max(1, int(examples * (1 - (validation_split or 0.0))))
    asked = batch_size or KERAS_DEFAULT_BATCH
    source = (f"fit's batch_size={batch_size}" if batch_size
              else f"fit's default batch_size of {KERAS_DEFAULT_BATCH}")
    if examples < asked:
        return examples, f"the {examples} examples given to fit ({source})"
    return asked, source


def _indexed_batch_types():
    """Keras 3's PyDataset and, where it is loaded, Keras 2's Sequence: data that gives
    its batches by index."""
    keras_2 = _keras_2()
    return (keras.utils.PyDataset,) + ((keras_2.utils.Sequence,) if keras_2 else ())


def data_signature(x, y=None, sample_weight=None, inputs=None):
    """The input signature of a Keras train step's `data` for one batch of `x`, `y`
    (arrays, tensors or nests of them, any number of examples; or a tf.data.Dataset,
    whose elements are that data) with the batch left None; without `x`, a functional
    model's `inputs` (its keras.Input tensors) give it.

    Returns:
      A nest of tf.TensorSpec as `train_step` receives its data: x, (x, y) or
      (x, y, sample_weight).
    """
    if isinstance(x, tf.data.Dataset):
        return tf.nest.map_structure(_unbatched_spec, x.element_spec)
    if x is None and inputs is not None:
        x = inputs if len(inputs) > 1 else inputs[0]
    data = (x,) + tuple(d for d in (y, sample_weight) if d is not None)
    specs = tf.nest.map_structure(_unbatched_spec, data)
    return specs[0] if len(specs) == 1 else specs


def _unbatched_spec(leaf):
    """A tf.TensorSpec of an array-like leaf (or a spec) with its leading dimension None."""
    shape = leaf.shape if not isinstance(leaf.shape, tf.TensorShape) else leaf.shape.as_list()
    shape = list(shape)
    dtype = tf.as_dtype(getattr(leaf.dtype, "name", leaf.dtype))
    return tf.TensorSpec([None] + shape[1:] if shape else shape, dtype)


def _fit_signature(model):
    """The signature of the Keras `fit` that `model` runs (Keras 3's or Keras 2's own,
    not that of a subclass's wrapper taking *args)."""
    keras_2 = _keras_2()
    base = keras_2.Model if keras_2 and isinstance(model, keras_2.Model) else keras.Model
    return inspect.signature(base.fit)


def _replicas(model):
    return getattr(getattr(model, "distribute_strategy", None), "num_replicas_in_sync", 1)


def _per_replica(model, found):
    replicas = _replicas(model)
    if not found or replicas <= 1:
        return found
    size, source = found
    return math.ceil(size / replicas), f"{source}, over {replicas} replicas"


def optimizer_state(model):
    """What `model`'s optimizer holds beside the gradients in `fit`'s step, or None.

    Its variables (slots such as Adam's two per weight, its iteration count; one copy
    per replica under a strategy) are alive through the step. Updating a weight makes
    temporaries the size of its gradient (Adam's new moments and step: counted as
    UPDATE_TEMPORARIES of them). Keras updates each weight as soon as its gradient is
    made, freeing it then, except where the update needs every gradient first: a loss
    scale (mixed precision) checks them all, a global norm clips them together, and
    replicas sum them together. Asked when the step plans: Keras 3's `fit` has built
    the optimizer by then; Keras 2 builds it inside the first step, after the
    gradients, so its slots are counted from a copy built on one small weight.
    """
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        return None
    sizes = [_variable_bytes(v) for v in _optimizer_variables(optimizer)]
    weights = list(getattr(model, "trainable_variables", ()))
    if len(sizes) < len(weights):  # (not built yet: fewer variables than weights)
        slots = _slots_per_weight(optimizer)
        sizes += [_variable_bytes(w) for w in weights for _ in range(slots)]
    waits_for_all = (isinstance(optimizer, _loss_scale_optimizer_types())
                     or getattr(optimizer, "global_clipnorm", None) is not None
                     or _replicas(model) > 1)
    return beside_lib.Beside(
        resident_sizes=tuple(sizes),
        source=f"{type(optimizer).__name__}'s {len(sizes)} variables and its update",
        update_temporaries=UPDATE_TEMPORARIES, updates_each_gradient=not waits_for_all)


def _optimizer_variables(optimizer):
    """An optimizer's variables (a property in Keras 3 and Keras 2's optimizers, a
    method in Keras 2's legacy ones)."""
    variables = optimizer.variables
    return list(variables() if callable(variables) else variables)


def _slots_per_weight(optimizer):
    """How many variables of a weight's shape `optimizer` keeps per weight (Adam: 2),
    read from a copy of it that applies one gradient to a small weight of its own,
    outside any trace; 0 where the optimizer cannot be copied from its config."""
    probe_shape = [3]
    try:
        with tf.init_scope():
            probe = type(optimizer).from_config(optimizer.get_config())
            weight = tf.Variable(tf.zeros(probe_shape))
            probe.apply_gradients([(tf.zeros_like(weight), weight)])
    except (TypeError, ValueError, NotImplementedError, AttributeError) as error:
        _log.info("memsave: %s's slots are not counted (%s)", type(optimizer).__name__, error)
        return 0
    return sum(1 for v in _optimizer_variables(probe) if v.shape.as_list() == probe_shape)


def _loss_scale_optimizer_types():
    keras_2 = _keras_2()
    return (keras.optimizers.LossScaleOptimizer,) + (
        (keras_2.mixed_precision.LossScaleOptimizer,) if keras_2 else ())


def _variable_bytes(variable):
    return math.prod(variable.shape) * tf.as_dtype(variable.dtype).size


@contextlib.contextmanager
def planned_for_fit(model, args, kwargs):
    """Plans the gradients traced inside for the batch of `model.fit(*args, **kwargs)`,
    with the model's optimizer state held beside them."""
    if getattr(model, "train_function", None) is not None:
        # A step traced already is not traced again: there is nothing to plan, and no
        # data is read ahead.
        yield
        return
    with beside_lib.holding(lambda: optimizer_state(model)):
        if batch_lib.current() is not None:  # the caller's own memsave.batch_size wins
            yield
            return
        try:
            arguments = _fit_signature(model).bind(model, *args, **kwargs).arguments
        except TypeError:  # let fit itself say what is wrong with its arguments
            arguments = {}
        found = _per_replica(model, fit_batch_size(
            arguments.get("x"), arguments.get("batch_size"), arguments.get("validation_split")))
        if found is None:
            _log.info("memsave: fit's batch is unknown before it runs (a generator?); "
                      "wrap fit in memsave.batch_size(n) to plan for it")
            yield
            return
        with batch_lib.batch_size(*found):
            yield


def fit_planned_for_its_batch(fit):
    """`fit` (a Keras Model's, unbound) wrapped in `planned_for_fit`."""
    if getattr(fit, "memsave_planned", False):
        return fit

    @functools.wraps(fit)
    def planned_fit(self, *args, **kwargs):
        with planned_for_fit(self, args, kwargs):
            return fit(self, *args, **kwargs)

    planned_fit.memsave_planned = True
    return planned_fit
