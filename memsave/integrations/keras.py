"""Keras 3 (TensorFlow backend): `model.fit` with memsave gradients.

Keras' own TensorFlow train step computes gradients with a `GradientTape`. Here
the same step computes the loss symbolically inside Keras' compiled
`tf.function` and takes its gradients with `memsave.gradients`; everything else
is Keras': metrics and the "loss" tracker, loss scaling (`LossScaleOptimizer`,
mixed precision), `model.optimizer.apply_gradients`, distribution strategies.

Three ways in, pick one:

    # 1. a functional (or subclassed) model
    model = memsave.keras.MemsaveModel(inputs, outputs, checkpoints='memory')

    # 2. a Sequential model
    model = memsave.keras.MemsaveSequential([...], checkpoints='memory')

    # 3. any existing model, e.g. keras.applications.ResNet50(weights=None)
    model = memsave.keras.enable(model, checkpoints='memory')

    model.compile(optimizer='adam', loss='sparse_categorical_crossentropy')
    model.fit(x, y)

Keras traces the train step with a batch of None; each of these `fit`s plans it for the
batch it is given (its `batch_size`, a dataset's batch: memsave.integrations.keras_batch),
and `memsave.last_report()` names that batch.

Or, in your own `Model` subclass, `return memsave.keras.train_step(self, data)`
from `train_step`.

Needs graph execution (the default; not `run_eagerly=True`). XLA is fine:
`jit_compile` keeps Keras' meaning (`'auto'`, the default, is XLA where Keras
chooses it, i.e. with an accelerator; `True` always), and the recomputation
survives compilation (memsave's copies depend on their segment's gradient through
data, which XLA cannot merge away: see memsave.build).

This module imports Keras; `import memsave` does not import it (use
`memsave.keras`, which loads this module on first use).
"""

import dataclasses
import logging
import types

import keras
import tensorflow as tf
# Functional models are this class; subclassing it directly (rather than
# keras.Model) keeps Keras from rewriting MemsaveModel's bases on first use.
from keras.src.models.functional import Functional as _Functional

from memsave import capacity
from memsave import offload as offload_lib
from memsave import rewrite as _rewrite
from memsave.errors import MemsaveError
from memsave.integrations import keras_batch
from memsave.integrations.optimizers import check_checkpoints
from memsave.strategies.planned import budget as _budget

_log = logging.getLogger(__name__)

DEFAULT_CHECKPOINTS = "memory"

_RUN_EAGERLY_HINT = (
    "memsave rewrites the graph of Keras' compiled train step, so the step must be "
    "compiled: call model.compile(..., run_eagerly=False) (the default), or, in a "
    "custom loop, wrap your step in @tf.function.")


def _check_backend():
    backend = keras.backend.backend()
    if backend != "tensorflow":
        raise MemsaveError(
            f"memsave.keras needs the TensorFlow backend of Keras, but Keras runs on "
            f"{backend!r}; set KERAS_BACKEND=tensorflow before importing keras.")


def _unscale_loss_for_distribution(loss):
    # Keras' own train step reports the loss before its per-replica scaling.
    from keras.src.losses.loss import unscale_loss_for_distribution
    return unscale_loss_for_distribution(loss)


def _batch_size(x):
    first = next(t for t in keras.tree.flatten(x) if t is not None)
    return tf.shape(first)[0]


def _tf_variable(variable):
    """The TensorFlow variable behind a Keras variable (what the graph reads)."""
    if isinstance(variable, keras.Variable):
        # Outside a layer's call (no autocast scope) `value` is the backend
        # variable itself: a tf.Variable, or a distributed one under a strategy.
        return variable.value
    return variable


def train_step(model, data, checkpoints=DEFAULT_CHECKPOINTS, offload=False):
    """One Keras training step whose gradients come from `memsave.gradients`.

    The same steps as Keras' TensorFlow `train_step` (forward pass with
    `training=True`, `compute_loss`, the "loss" tracker, `optimizer.scale_loss`,
    `optimizer.apply_gradients`, `compute_metrics`) with memsave in place of the
    `GradientTape`. Call it from a model's `train_step`.

    Args:
      model: a compiled `keras.Model` (TensorFlow backend).
      data: the batch as Keras passes it to `train_step`: `x`, `(x, y)` or
        `(x, y, sample_weight)`.
      checkpoints: memsave strategy: 'memory' (default), 'speed', 'collection'
        or a list of tensors to keep.
      offload: host offload of checkpoints, as for memsave.gradients.
    Returns:
      The dict of metric results, as Keras' `train_step` returns.
    Raises:
      MemsaveError: when run eagerly (`run_eagerly=True`), on a non-TensorFlow
        backend, or for a graph memsave cannot rewrite.
    """
    _check_backend()
    if tf.executing_eagerly():
        raise MemsaveError(f"memsave.keras train_step is running eagerly. {_RUN_EAGERLY_HINT}")
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    if model._call_has_training_arg:  # pylint: disable=protected-access
        y_pred = model(x, training=True)
    else:
        y_pred = model(x)
    # Keras' wrapper around compute_loss (handles overridden signatures).
    loss = model._compute_loss(  # pylint: disable=protected-access
        x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True)
    model._loss_tracker.update_state(  # pylint: disable=protected-access
        _unscale_loss_for_distribution(loss), sample_weight=_batch_size(x))
    if model.optimizer is not None:
        loss = model.optimizer.scale_loss(loss)
    trainable_weights = model.trainable_weights
    if trainable_weights:
        grads = _rewrite.gradients(loss, [_tf_variable(v) for v in trainable_weights],
                                   checkpoints=checkpoints, offload=offload)
        model.optimizer.apply_gradients(zip(grads, trainable_weights))
    else:
        _log.warning("memsave.keras: the model has no trainable weights; nothing to train")
    return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)


class MemsaveTrainStep:
    """Mixin for `keras.Model` subclasses: `fit` computes gradients with memsave.

    Put it before the Keras base class: `class M(MemsaveTrainStep, keras.Model)`.
    The strategy is the attribute `memsave_checkpoints` (default 'memory'), host
    offload the attribute `memsave_offload` (default False; see memsave.offload).
    """

    memsave_checkpoints = DEFAULT_CHECKPOINTS
    memsave_offload = False

    def fit(self, *args, **kwargs):
        """Keras' `fit`, its train step planned for the batch it is given
        (memsave.integrations.keras_batch; the report names the batch)."""
        with keras_batch.planned_for_fit(self, args, kwargs):
            return super().fit(*args, **kwargs)

    def train_step(self, data):
        """Keras' train step with memsave gradients (see `train_step`).

        Args:
          data: the batch Keras passes in.
        Returns:
          The dict of metric results.
        """
        return train_step(self, data, self.memsave_checkpoints, self.memsave_offload)

    def get_config(self):
        """The Keras config plus the strategy (a name or a budget) and the offload
        setting, for saving."""
        config = super().get_config()
        checkpoints = self.memsave_checkpoints
        if isinstance(checkpoints, str):
            config["memsave_checkpoints"] = checkpoints
        elif isinstance(checkpoints, _budget):
            config["memsave_checkpoints"] = {"budget": checkpoints.limit,
                                             "time": checkpoints.time,
                                             "unknown_dim_size": checkpoints.unknown_dim_size,
                                             "offload": _offload_config(checkpoints.offload)}
        config["memsave_offload"] = _offload_config(self.memsave_offload)
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        """Rebuilds a saved model, strategy included."""
        config = dict(config)
        checkpoints = config.pop("memsave_checkpoints", cls.memsave_checkpoints)
        if isinstance(checkpoints, dict) and "budget" in checkpoints:
            checkpoints = _budget(checkpoints["budget"], time=checkpoints.get("time"),
                                  unknown_dim_size=checkpoints.get("unknown_dim_size"),
                                  offload=_offload_from_config(checkpoints.get("offload")))
        offload = _offload_from_config(config.pop("memsave_offload", cls.memsave_offload))
        model = super().from_config(config, custom_objects=custom_objects)
        model.memsave_checkpoints = checkpoints
        model.memsave_offload = offload
        return model


def _offload_config(offload):
    """An offload setting as Keras config (an Offload becomes a dict)."""
    return dataclasses.asdict(offload) if isinstance(offload, offload_lib.Offload) else offload


def _offload_from_config(config):
    return offload_lib.Offload(**config) if isinstance(config, dict) else config


@keras.saving.register_keras_serializable(package="memsave")
class MemsaveModel(MemsaveTrainStep, _Functional):
    """A functional `keras.Model` whose `fit` uses memsave gradients.

        model = memsave.keras.MemsaveModel(inputs, outputs, checkpoints='memory')

    For a subclassed model use the mixin instead:
    `class MyModel(memsave.keras.MemsaveTrainStep, keras.Model)`.
    """

    def __init__(self, *args, checkpoints=DEFAULT_CHECKPOINTS, offload=False, **kwargs):
        """Builds the model as `keras.Model(inputs, outputs)` would.

        Args:
          *args, **kwargs: as for a functional `keras.Model` (inputs, outputs,
            name, ...).
          checkpoints: memsave strategy for `fit`: 'memory' (default),
            'speed', 'collection' or a list of tensors.
          offload: host offload of checkpoints, as for memsave.gradients.
        Raises:
          MemsaveError: if `checkpoints` names no strategy or `offload` is bad.
        """
        check_checkpoints(checkpoints)
        offload_lib.normalise(offload)
        super().__init__(*args, **kwargs)
        self.memsave_checkpoints = checkpoints
        self.memsave_offload = offload


@keras.saving.register_keras_serializable(package="memsave")
class MemsaveSequential(MemsaveTrainStep, keras.Sequential):
    """A `keras.Sequential` whose `fit` uses memsave gradients.

        model = memsave.keras.MemsaveSequential([...layers...], checkpoints='memory')
    """

    def __init__(self, layers=None, *args, checkpoints=DEFAULT_CHECKPOINTS, offload=False,
                 **kwargs):
        """Builds the model as `keras.Sequential` would.

        Args:
          layers, *args, **kwargs: as for `keras.Sequential`.
          checkpoints: memsave strategy for `fit`.
          offload: host offload of checkpoints, as for memsave.gradients.
        Raises:
          MemsaveError: if `checkpoints` names no strategy or `offload` is bad.
        """
        check_checkpoints(checkpoints)
        offload_lib.normalise(offload)
        super().__init__(layers, *args, **kwargs)
        self.memsave_checkpoints = checkpoints
        self.memsave_offload = offload


def enable(model, checkpoints=DEFAULT_CHECKPOINTS, offload=False):
    """Makes an existing Keras model's `fit` compute gradients with memsave.

    For models you did not define, e.g. `keras.applications.ResNet50(weights=None)`.
    Works before or after `compile`; call `disable(model)` to go back.

    Args:
      model: a `keras.Model` (TensorFlow backend).
      checkpoints: memsave strategy: 'memory' (default), 'speed', 'collection'
        or a list of tensors to keep.
      offload: host offload of checkpoints, as for memsave.gradients.
    Returns:
      `model`, changed in place.
    Raises:
      MemsaveError: if `model` is not a Keras model, the backend is not
        TensorFlow, or `checkpoints` names no strategy.
    """
    _check_backend()
    check_checkpoints(checkpoints)
    offload_lib.normalise(offload)
    if not isinstance(model, keras.Model):
        model_keras = keras_batch.keras_of(model)
        hint = ("; a Keras 2 (tf_keras) model trains with memsave under memsave.patch(): "
                "wrap its fit in `with memsave.patch(checkpoints=...)`"
                if model_keras is not None and model_keras.__name__ == "tf_keras" else "")
        raise MemsaveError(f"memsave.keras.enable takes a keras.Model (Keras 3), got "
                           f"{type(model).__name__}{hint}")

    def memsave_train_step(data):
        return train_step(model, data, checkpoints, offload)

    memsave_train_step.memsave_checkpoints = checkpoints
    memsave_train_step.memsave_offload = offload
    # An instance attribute wins over the class's train_step; the next fit
    # builds its train function from it.
    model.train_step = memsave_train_step
    if "fit" not in vars(model):
        model.fit = types.MethodType(keras_batch.fit_planned_for_its_batch(_class_fit), model)
    model.train_function = None
    return model


def _model_settings(model):
    """(checkpoints, offload) `model`'s own fit uses with memsave: a MemsaveModel's or an
    enabled model's, else the defaults."""
    step = vars(model).get("train_step")
    if step is not None and hasattr(step, "memsave_checkpoints"):
        return step.memsave_checkpoints, getattr(step, "memsave_offload", False)
    if isinstance(model, MemsaveTrainStep):
        return model.memsave_checkpoints, model.memsave_offload
    return DEFAULT_CHECKPOINTS, False


def max_batch_size(model, memory_limit=None, x=None, y=None, sample_weight=None,
                   checkpoints=None, max_batch=capacity.MAX_BATCH,
                   headroom=capacity.HEADROOM):
    """The largest batch `model.fit` is predicted to train with in `memory_limit`, with
    memsave and with plain Keras, before anything runs.

    Traces (does not run) the model's train step once per batch tried, as `fit` would
    run it with memsave (memsave.keras.train_step, compiled with XLA where the model's
    `jit_compile` is), the optimizer's state and update included
    (keras_batch.optimizer_state); each trace's report gives memsave's and plain
    tf.gradients' predicted peaks (memsave.capacity). Under a distribution strategy the
    batches are per replica. A model with its own `train_step` is sized as Keras' step.

        capacity = memsave.keras.max_batch_size(model, "8GiB", x=x[:1], y=y[:1])
        model.fit(x, y, batch_size=capacity.batch_size)   # with memsave.keras / the patch
        print(capacity.summary())

    Args:
      model: a compiled keras.Model (TensorFlow backend), built.
      memory_limit: bytes or text ("8GiB"); None: the device's (a GPU's memory, or the
        CPU allocator's cap).
      x, y, sample_weight: some of the data `fit` will get (any number of examples: only
        their shapes past the batch and dtypes are read), or a tf.data.Dataset of it;
        without x, a functional model's inputs (then give y where the loss needs it).
      checkpoints: memsave's strategy, as for MemsaveModel (None: the model's own, where
        it is a MemsaveModel or enabled, else 'memory'); its host offload is the model's.
      max_batch: the largest batch to try.
      headroom: the share of the limit the answers leave free (default 10%: a step's
        peak moves a little from run to run).
    Returns:
      A memsave.capacity.Capacity: `batch_size`, `baseline_batch_size`, `peaks` (per
      batch traced), `summary()`.
    Raises:
      MemsaveError: an uncompiled or unbuilt model, a bad limit, no limit known.
    """
    _check_backend()
    own_checkpoints, offload = _model_settings(model)
    checkpoints = own_checkpoints if checkpoints is None else check_checkpoints(checkpoints)
    if getattr(model, "optimizer", None) is None:
        raise MemsaveError("max_batch_size needs a compiled model: call model.compile("
                           "optimizer=..., loss=...) first")
    if not model.built:
        raise MemsaveError("max_batch_size needs a built model: call it once on a batch, or "
                           "build it (model.build(input_shape)) first")
    if x is None and not getattr(model, "inputs", None):
        raise MemsaveError("max_batch_size needs x= (some examples of fit's data) for a "
                           "model without keras.Input tensors")
    if not model.optimizer.built:
        model.optimizer.build(model.trainable_variables)  # (as fit does before tracing)
    signature = keras_batch.data_signature(x, y, sample_weight, getattr(model, "inputs", None))

    def step(data):
        return train_step(model, data, checkpoints, offload)

    return capacity.max_batch_size(step, [signature], memory_limit,
                                   optimizer_state=lambda: keras_batch.optimizer_state(model),
                                   max_batch=max_batch, headroom=headroom,
                                   jit_compile=getattr(model, "jit_compile", False) is True)


def _class_fit(model, *args, **kwargs):
    # The class's fit at call time (memsave.patch may wrap it for a while).
    return type(model).fit(model, *args, **kwargs)


def disable(model):
    """Undoes `enable`: the model's `fit` uses its class's train step again.

    Args:
      model: a model passed to `enable` (anything else is left as it is).
    Returns:
      `model`.
    """
    step = vars(model).get("train_step")
    if step is not None and hasattr(step, "memsave_checkpoints"):
        del model.train_step
        model.train_function = None
    if getattr(vars(model).get("fit"), "memsave_planned", False):
        del model.fit
    return model
