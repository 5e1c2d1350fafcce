"""memsave for code that takes a gradient function or a `tf.compat.v1` optimizer.

Two things, neither of which patches anything globally:

- `gradient_function(checkpoints)`: a function with the signature of
  `tf.compat.v1.gradients` (which accepts every `tf.gradients` call too) that
  computes its gradients with memsave and the given checkpoint strategy. Hand it
  to whatever takes a gradient function.
- `MemsaveOptimizer(optimizer, checkpoints)`: a `tf.compat.v1.train.Optimizer`
  that computes gradients with memsave and applies them with the optimizer it
  wraps (slots, hyper-parameters, distribution handling all stay the wrapped
  optimizer's).

Both need a graph: a `tf.compat.v1` graph, or the body of a `tf.function`.
"""

import tensorflow as tf
from tensorflow.python.training import optimizer as _tf_optimizer_module

from memsave import offload as offload_lib
from memsave import rewrite as _rewrite
from memsave.errors import MemsaveError
from memsave.inputs import unknown_strategy_error
from memsave.strategies import STRATEGIES

_UNCONNECTED_NONE = tf.UnconnectedGradients.NONE

_EAGER_HINT = (
    "memsave rewrites a graph, so it needs one: put the training step in a "
    "tf.function, e.g.\n"
    "    @tf.function\n"
    "    def train_step(x, y):\n"
    "        loss = loss_fn(model(x), y)\n"
    "        grads = memsave.gradients(loss, model.trainable_variables, checkpoints='memory')\n"
    "        optimizer.apply_gradients(zip(grads, model.trainable_variables))\n"
    "        return loss")


def check_checkpoints(checkpoints):
    """Fails early on a checkpoint strategy that memsave.gradients would refuse later.

    Only names are checked here (lists and strategy objects are checked by
    `memsave.gradients` when it sees the graph).

    Args:
      checkpoints: what a caller wants to pass as `checkpoints=`.
    Returns:
      `checkpoints`, unchanged.
    Raises:
      MemsaveError: if it is a string that names no strategy, or None.
    """
    if checkpoints is None or (isinstance(checkpoints, str) and checkpoints not in STRATEGIES):
        raise unknown_strategy_error(checkpoints)
    return checkpoints


def gradient_function(checkpoints="collection", offload=False):
    """Returns a `tf.gradients`-compatible function that uses memsave.

    The returned function has the signature of `tf.compat.v1.gradients`
    (`ys, xs, grad_ys=None, name='gradients', colocate_gradients_with_ops=False,
    gate_gradients=False, aggregation_method=None, stop_gradients=None,
    unconnected_gradients=tf.UnconnectedGradients.NONE`), so both `tf.gradients`
    and `tf.compat.v1.gradients` call sites can take it unchanged.

    Args:
      checkpoints: the strategy for every call: 'collection', 'speed',
        'memory', or a list of tensors (or tensor names) to keep.
      offload: as for memsave.gradients (False, True, a device string or
        memsave.Offload).
    Returns:
      A function computing d(ys)/d(xs) with memsave.
    Raises:
      MemsaveError: if `checkpoints` names no strategy, or `offload` is not one.
    """
    check_checkpoints(checkpoints)
    offload_lib.normalise(offload)

    def memsave_gradients(ys, xs, grad_ys=None, name="gradients",
                          colocate_gradients_with_ops=False, gate_gradients=False,
                          aggregation_method=None, stop_gradients=None,
                          unconnected_gradients=_UNCONNECTED_NONE):
        """`tf.compat.v1.gradients` computed by memsave (see `gradient_function`).

        Args:
          ys, xs, grad_ys, name, colocate_gradients_with_ops, gate_gradients,
          aggregation_method, stop_gradients, unconnected_gradients: as for
            `tf.compat.v1.gradients`.
        Returns:
          One gradient per x (None where x does not reach ys).
        Raises:
          MemsaveError: outside a graph, or for a graph memsave cannot rewrite.
        """
        # Every argument is passed on, defaults included: tf.compat.v1.gradients does
        # not colocate gradients with their ops unless asked, memsave.gradients (like
        # tf.gradients) does.
        kwargs = dict(colocate_gradients_with_ops=colocate_gradients_with_ops,
                      gate_gradients=gate_gradients, aggregation_method=aggregation_method,
                      stop_gradients=stop_gradients, unconnected_gradients=unconnected_gradients)
        if name != "gradients":  # (the default: memsave's ops then go under "memsave")
            kwargs["name"] = name
        return _rewrite.gradients(ys, xs, grad_ys, checkpoints=checkpoints, offload=offload,
                                  **kwargs)

    memsave_gradients.checkpoints = checkpoints
    memsave_gradients.offload = offload
    return memsave_gradients


class MemsaveOptimizer(tf.compat.v1.train.Optimizer):
    """A `tf.compat.v1.train.Optimizer` whose gradients come from memsave.

    It wraps another v1 optimizer: `compute_gradients` (and so `minimize`) use
    `memsave.gradients` with the given strategy; `apply_gradients`, slots and
    variables are the wrapped optimizer's. Nothing global is patched.

        opt = memsave.MemsaveOptimizer(
            tf.compat.v1.train.AdamOptimizer(1e-3), checkpoints='memory')
        train_op = opt.minimize(loss)

    A `compute_gradients` override in the wrapped optimizer's class is not
    called (this class computes the gradients); put such processing between
    `compute_gradients` and `apply_gradients` instead.
    """

    def __init__(self, optimizer, checkpoints="collection", name=None, offload=False):
        """Wraps `optimizer`.

        Args:
          optimizer: a `tf.compat.v1.train.Optimizer` instance.
          checkpoints: memsave strategy: 'collection', 'speed', 'memory' or a
            list of tensors to keep.
          name: name for this optimizer; defaults to "Memsave" + the wrapped
            optimizer's name.
          offload: as for memsave.gradients (False, True, a device string or
            memsave.Offload).
        Raises:
          MemsaveError: if `optimizer` is not a v1 optimizer or `checkpoints`
            names no strategy.
        """
        if not isinstance(optimizer, tf.compat.v1.train.Optimizer):
            raise MemsaveError(
                f"MemsaveOptimizer wraps a tf.compat.v1.train.Optimizer, got "
                f"{type(optimizer).__name__}. For Keras optimizers use memsave.keras "
                "(model.fit) or memsave.gradients in your tf.function train step.")
        self._memsave_gradients = gradient_function(checkpoints, offload)
        self._optimizer = optimizer
        self._checkpoints = checkpoints
        super().__init__(use_locking=False, name=name or "Memsave" + optimizer.get_name())

    @property
    def optimizer(self):
        """The wrapped `tf.compat.v1.train.Optimizer`."""
        return self._optimizer

    @property
    def checkpoints(self):
        """The memsave strategy used for every `compute_gradients` call."""
        return self._checkpoints

    def compute_gradients(self, loss, var_list=None,
                          gate_gradients=tf.compat.v1.train.Optimizer.GATE_OP,
                          aggregation_method=None, colocate_gradients_with_ops=False,
                          grad_loss=None):
        """Computes (gradient, variable) pairs of `loss` with memsave.

        Same contract as `tf.compat.v1.train.Optimizer.compute_gradients`, except
        that it needs a graph even when `loss` is a callable.

        Args:
          loss: a scalar Tensor, or a callable returning one (called here).
          var_list: variables to differentiate; default: the trainable
            variables (of the graph's collections for a Tensor loss, the ones the
            callable read for a callable loss).
          gate_gradients: GATE_NONE, GATE_OP or GATE_GRAPH.
          aggregation_method: as for tf.gradients.
          colocate_gradients_with_ops: as for tf.compat.v1.gradients (where
            the gradient ops are placed).
          grad_loss: optional gradient for `loss`.
        Returns:
          A list of (gradient or None, variable) pairs.
        Raises:
          MemsaveError: when executing eagerly (memsave needs a graph).
          ValueError: bad gate_gradients, no variables, or invalid dtypes (as the
            wrapped TF optimizer would).
        """
        if tf.executing_eagerly():
            raise MemsaveError(
                f"MemsaveOptimizer.compute_gradients was called eagerly. {_EAGER_HINT}")
        if callable(loss):
            with tf.GradientTape() as tape:
                if var_list is not None:
                    tape.watch(var_list)
                loss = loss()
            if var_list is None:
                var_list = tape.watched_variables()
        gates = (self.GATE_NONE, self.GATE_OP, self.GATE_GRAPH)
        if gate_gradients not in gates:
            raise ValueError(
                f"gate_gradients must be one of Optimizer.GATE_NONE, GATE_OP, GATE_GRAPH; "
                f"got {gate_gradients!r}")
        # Same loss scaling as TF's own optimizers (mean reduction over replicas).
        loss = self._scale_loss(loss)
        self._assert_valid_dtypes([loss])
        if grad_loss is not None:
            self._assert_valid_dtypes([grad_loss])
        if var_list is None:
            var_list = (tf.compat.v1.trainable_variables()
                        + tf.compat.v1.get_collection(
                            tf.compat.v1.GraphKeys.TRAINABLE_RESOURCE_VARIABLES))
        else:
            var_list = tf.nest.flatten(var_list)
        if not var_list:
            raise ValueError("No variables to optimize.")
        # The tensor each variable is differentiated through (a ref variable's
        # ref, a resource variable itself), exactly as TF's optimizers pick it.
        targets = [_tf_optimizer_module._get_processor(v).target()  # pylint: disable=protected-access
                   for v in var_list]
        grads = self._memsave_gradients(
            loss, targets, grad_ys=grad_loss,
            gate_gradients=(gate_gradients == self.GATE_OP),
            aggregation_method=aggregation_method,
            colocate_gradients_with_ops=colocate_gradients_with_ops)
        if gate_gradients == self.GATE_GRAPH:
            grads = tf.tuple(grads)
        grads_and_vars = list(zip(grads, var_list))
        self._assert_valid_dtypes(
            [v for g, v in grads_and_vars if g is not None and v.dtype != tf.resource])
        return grads_and_vars

    def apply_gradients(self, grads_and_vars, global_step=None, name=None, **kwargs):
        """Applies the gradients with the wrapped optimizer.

        Args:
          grads_and_vars, global_step, name, **kwargs: as for the wrapped
            optimizer's `apply_gradients`.
        Returns:
          The wrapped optimizer's update op.
        """
        return self._optimizer.apply_gradients(
            grads_and_vars, global_step=global_step, name=name, **kwargs)

    def get_slot(self, var, name):
        """The wrapped optimizer's slot `name` for `var` (or None)."""
        return self._optimizer.get_slot(var, name)

    def get_slot_names(self):
        """The wrapped optimizer's slot names."""
        return self._optimizer.get_slot_names()

    def variables(self):
        """The wrapped optimizer's variables."""
        return self._optimizer.variables()
