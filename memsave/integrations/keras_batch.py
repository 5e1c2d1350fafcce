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

Imports no Keras: reads Keras 3 (`keras`) and Keras 2 (`tf_keras`) where the program
has imported them. Loaded by memsave.keras and by memsave.patch where Keras is in use.
"""

import contextlib
import functools
import inspect
import logging
import math
import sys

import tensorflow as tf

from memsave import batch as batch_lib
from memsave import beside as beside_lib

_log = logging.getLogger(__name__)

KERAS_DEFAULT_BATCH = 32
# Temporaries of an optimizer's update of one weight, in its gradient's bytes (optimizer_state).
UPDATE_TEMPORARIES = 2


def loaded_keras():
    """The Keras modules the program has imported, of those memsave works with: Keras 3
    on TensorFlow (`keras`) and Keras 2 (`tf_keras`). memsave imports neither here."""
    found = []
    keras = sys.modules.get("keras")
    version = getattr(keras, "version", None)
    if (callable(version) and version().startswith("3")
            and keras.backend.backend() == "tensorflow"):
        found.append(keras)
    keras_2 = sys.modules.get("tf_keras")
    if keras_2 is not None and hasattr(keras_2, "Model"):
        found.append(keras_2)
    return found


def keras_of(model):
    """The loaded Keras module whose Model `model` is, or None."""
    return next((k for k in loaded_keras() if isinstance(model, k.Model)), None)


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
    """Keras 3's PyDataset and Keras 2's Sequence, where loaded: data that gives its
    batches by index."""
    return tuple(getattr(k.utils, name) for k in loaded_keras()
                 for name in ("PyDataset", "Sequence") if hasattr(k.utils, name))


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
    not that of a subclass's wrapper taking *args); None for a model of neither."""
    keras = keras_of(model)
    return None if keras is None else inspect.signature(keras.Model.fit)


def _replicas(model):
    return getattr(getattr(model, "distribute_strategy", None), "num_replicas_in_sync", 1)


def _per_replica(model, found):
    replicas = _replicas(model)
    if not found or replicas <= 1:
        return found
    size, source = found
    return math.ceil(size / replicas), f"{source}, over {replicas} replicas"


def optimizer_state(model, slots_to_come=0):
    """What `model`'s optimizer holds beside the gradients in `fit`'s step, or None.

    Its variables (slots such as Adam's two per weight, its iteration count; one copy
    per replica under a strategy) are alive through the step. Updating a weight makes
    temporaries the size of its gradient (Adam's new moments and step: counted as
    UPDATE_TEMPORARIES of them). Keras updates each weight as soon as its gradient is
    made, freeing it then, except where the update needs every gradient first: a loss
    scale (mixed precision) checks them all, a global norm clips them together, and
    replicas sum them together. Asked when the step plans: Keras 3's `fit` has built
    the optimizer by then; Keras 2 builds it inside the first step, after the
    gradients, and `slots_to_come` (keras_2_slots_per_weight) counts its slots then.
    """
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        return None
    sizes = [_variable_bytes(v) for v in optimizer_variables(optimizer)]
    source = f"{type(optimizer).__name__}'s {len(sizes)} variables and its update"
    if slots_to_come and not _built(optimizer):
        weights = list(model.trainable_variables)
        sizes += [_variable_bytes(w) for w in weights for _ in range(slots_to_come)]
        source = (f"{type(optimizer).__name__}'s {len(sizes)} variables (its "
                  f"{slots_to_come * len(weights)} slots made in the first step) and its update")
    waits_for_all = (isinstance(optimizer, _loss_scale_optimizer_types())
                     or getattr(optimizer, "global_clipnorm", None) is not None
                     or _replicas(model) > 1)
    return beside_lib.Beside(
        resident_sizes=tuple(sizes), source=source,
        update_temporaries=UPDATE_TEMPORARIES, updates_each_gradient=not waits_for_all)


def optimizer_variables(optimizer):
    """An optimizer's variables: a list in Keras 3, a callable list in Keras 2, a
    method in Keras 2's legacy optimizers."""
    variables = optimizer.variables
    return list(variables() if callable(variables) else variables)


def _built(optimizer):
    """Whether `optimizer` has made its slots: Keras 3's and Keras 2's `built` flags; a
    legacy Keras 2 optimizer once it holds a slot."""
    for flag in ("built", "_built"):
        value = getattr(optimizer, flag, None)
        if isinstance(value, bool):
            return value
    return bool(getattr(optimizer, "_slots", None))


def keras_2_slots_per_weight(model):
    """How many variables of a weight's shape a Keras 2 model's optimizer will make per
    weight in the first step (Adam: 2); 0 for a Keras 3 model or a built optimizer.

    Read from a copy of the optimizer that applies one gradient to a small weight of
    its own. Call it eagerly, before `fit` traces: inside a trace, or in a replica's
    thread under a distribution strategy, the copy's variables could not be made.
    """
    optimizer = getattr(model, "optimizer", None)
    keras = keras_of(model)
    if optimizer is None or keras is None or keras.__name__ != "tf_keras" or _built(optimizer):
        return 0
    probe_shape = [3]
    try:
        probe = type(optimizer).from_config(optimizer.get_config())
        weight = tf.Variable(tf.zeros(probe_shape))
        probe.apply_gradients([(tf.zeros_like(weight), weight)])
    except (TypeError, ValueError, NotImplementedError, AttributeError, RuntimeError) as error:
        _log.info("memsave: %s's slots are not counted (%s)", type(optimizer).__name__, error)
        return 0
    return sum(1 for v in optimizer_variables(probe) if v.shape.as_list() == probe_shape)


def _loss_scale_optimizer_types():
    """Keras 3's and Keras 2's LossScaleOptimizer, where loaded."""
    return tuple(getattr(module, "LossScaleOptimizer") for k in loaded_keras()
                 for module in (k.optimizers, getattr(k, "mixed_precision", None))
                 if hasattr(module, "LossScaleOptimizer"))


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
    slots_to_come = keras_2_slots_per_weight(model)
    with beside_lib.holding(lambda: optimizer_state(model, slots_to_come)):
        if batch_lib.current() is not None:  # the caller's own memsave.batch_size wins
            yield
            return
        signature = _fit_signature(model)
        try:
            arguments = signature.bind(model, *args, **kwargs).arguments if signature else {}
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
