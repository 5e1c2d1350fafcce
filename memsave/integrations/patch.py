"""Route `tf.gradients` and its kin through memsave for a while.

    with memsave.patch(checkpoints='memory'):
        train_op = tf.compat.v1.train.AdamOptimizer().minimize(loss)

    @memsave.patch(checkpoints='speed')
    def build_graph(): ...

While a patch is active these names compute their gradients with memsave:

- `tf.gradients` (also reachable as `tf.compat.v2.gradients`);
- `tf.compat.v1.gradients`;
- the `gradients` function that `tf.compat.v1.train.Optimizer.compute_gradients`
  (and so `minimize`) looks up at call time: the module attribute
  `tensorflow.python.ops.gradients.gradients`;
- the `gradients` function that `tf.hessians` and `tf.compat.v1.hessians` call:
  `tensorflow.python.ops.gradients_impl.gradients` (the second-order calls those
  make inside a while loop take tensors of the enclosing graph, which memsave
  leaves to plain tf.gradients: see memsave.inputs);
- `tf.GradientTape` (also `tf.autodiff.GradientTape`, `tf.compat.v1/v2.GradientTape`):
  tapes made while the patch is active are memsave.GradientTape with the patch's
  strategy (Keras' own `fit` makes one when it traces its train step, so a plain
  `model.fit` first called under the patch saves memory; Keras keeps that traced step,
  so it keeps saving after the patch, and a step traced before the patch never saves).
  A tape made while no patch is active answers as tf.GradientTape.
- Keras 3's `keras.Model.fit` and Keras 2's `tf_keras.Model.fit`, where the program
  imported them before the patch starts: it plans the step it traces for the batch it
  is given (memsave.integrations.keras_batch), not for the batch of None Keras traces
  with.

On exit, also when the body raises, every one of them is put back exactly as it
was (the same object, or no attribute if there was none). Patches nest: the
innermost active patch's strategy wins, and the outer one is in force again once
the inner exits. Entering the same strategy twice is harmless.

memsave's own rewrite calls `tf.gradients` for each segment; while a patch is
active such calls made from inside memsave go to the original function, never
back into memsave (see `original_gradients`).

Importing this module patches nothing.
"""

import contextlib
import importlib
import inspect
import logging
import sys
import threading

import tensorflow as tf

from memsave.errors import MemsaveError
from memsave import offload as offload_lib
from memsave.integrations.optimizers import check_checkpoints, gradient_function

_log = logging.getLogger(__name__)

# Where the gradient functions are looked up: (dotted path from the `tensorflow`
# module or an importable module name, attribute). Resolved when a patch starts.
_API_SITES = ("", "compat.v2", "compat.v1")      # tf.gradients, tf.compat.v{2,1}.gradients
# What v1 optimizers call, and what tf.hessians calls.
_MODULE_SITES = ("tensorflow.python.ops.gradients", "tensorflow.python.ops.gradients_impl")
_ATTRIBUTE = "gradients"
# Where tf.GradientTape is looked up (from the `tensorflow` module).
_TAPE_SITES = ("", "autodiff", "compat.v1", "compat.v2")
_TAPE_ATTRIBUTE = "GradientTape"
# Keras' Model.fit (3 and 2), planned for the batch it is given (memsave.batch).
_FIT_ATTRIBUTE = "fit"

_lock = threading.RLock()
# The active patches, innermost last; each entry is (entry token, (checkpoints, offload)).
_active = []
# While any patch is active: the saved attribute slots, in the order they were
# patched. Each is (owner, attribute, present, value): owner's __dict__ had the
# attribute (`present`) with `value`.
_saved = []
# Original function per patched owner id, for calls that must bypass memsave.
_originals = {}
_local = threading.local()


def _owners(api_paths, module_names=()):
    """The objects at `api_paths` (dotted paths from the `tensorflow` module) and the
    modules `module_names`, each once, in that order."""
    import tensorflow as tf
    owners = []
    for path in api_paths:
        owner = tf
        for part in filter(None, path.split(".")):
            owner = getattr(owner, part)
        owners.append(owner)
        wrapped = vars(owner).get("_tfmw_wrapped_module")
        if wrapped is not None:
            # tf.compat.v1 is a TFModuleWrapper: its setattr also writes the module
            # it wraps; save that module's slot too so it is restored exactly.
            owners.append(wrapped)
    owners.extend(importlib.import_module(name) for name in module_names)
    unique = []
    for owner in owners:
        if all(owner is not seen for seen in unique):
            unique.append(owner)
    return unique


def _sites():
    """The objects whose `gradients` attribute a patch replaces, in patch order."""
    return _owners(_API_SITES, _MODULE_SITES)


def _tape_sites():
    """The objects whose `GradientTape` attribute a patch replaces."""
    return _owners(_TAPE_SITES)


def _in_memsave():
    return getattr(_local, "depth", 0) > 0


@contextlib.contextmanager
def _inside_memsave():
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1


def _make_dispatcher(original):
    """A stand-in for `original` that sends calls to the innermost patch's memsave."""

    signature = inspect.signature(original)

    @tf.autograph.experimental.do_not_convert
    def gradients(*args, **kwargs):
        with _lock:
            setting = _active[-1][1] if _active else None
        if setting is None or _in_memsave():
            return original(*args, **kwargs)
        # tf.gradients and tf.compat.v1.gradients differ in their positional
        # order: bind to the original's signature, pass everything by name.
        arguments = signature.bind(*args, **kwargs).arguments
        with _inside_memsave():
            return gradient_function(*setting)(**arguments)

    gradients.__name__ = getattr(original, "__name__", "gradients")
    gradients.__qualname__ = gradients.__name__
    gradients.__doc__ = (f"Patched by memsave.patch: computes with memsave.\n\n"
                         f"{getattr(original, '__doc__', '') or ''}")
    gradients.__wrapped__ = original
    gradients.memsave_original = original
    return gradients


def _keras_fit_sites():
    """The Model classes whose `fit` a patch plans for the batch it is given: Keras 3's
    `keras.Model` where Keras runs on TensorFlow, and Keras 2's `tf_keras.Model`, each
    where the program has imported it (a patch never imports Keras)."""
    from memsave.integrations import keras_batch
    return [keras.Model for keras in keras_batch.loaded_keras()]


def _install():
    slots = [(owner, _ATTRIBUTE) for owner in _sites()]
    slots += [(owner, _TAPE_ATTRIBUTE) for owner in _tape_sites()]
    slots += [(owner, _FIT_ATTRIBUTE) for owner in _keras_fit_sites()]
    # Read everything before writing anything: a TFModuleWrapper's setattr also
    # writes the module it wraps.
    for owner, attribute in slots:
        present = attribute in vars(owner)
        _saved.append((owner, attribute, present, vars(owner).get(attribute)))
        if attribute == _ATTRIBUTE:
            _originals[id(owner)] = getattr(owner, attribute)
    dispatchers = {}
    try:
        for owner, attribute in slots:
            if attribute == _TAPE_ATTRIBUTE:
                setattr(owner, attribute, _patched_tape_class(getattr(owner, attribute)))
                continue
            if attribute == _FIT_ATTRIBUTE:
                from memsave.integrations import keras_batch
                setattr(owner, attribute,
                        keras_batch.fit_planned_for_its_batch(getattr(owner, attribute)))
                continue
            original = _originals[id(owner)]
            key = id(original)
            if key not in dispatchers:
                dispatchers[key] = _make_dispatcher(original)
            setattr(owner, attribute, dispatchers[key])
    except (AttributeError, TypeError):
        _uninstall()
        raise
    _log.debug("memsave.patch: routed %d gradients attributes and tf.GradientTape through "
               "memsave", len(slots))


_tape_classes = {}


def _patched_tape_class(original):
    """memsave.GradientTape taking the innermost active patch's strategy (one class per
    original, so `isinstance` checks against it stay true while patched)."""
    from memsave.tape import GradientTape

    if getattr(original, "memsave_original", None) is not None:
        return original
    if id(original) not in _tape_classes:
        class PatchedGradientTape(GradientTape):
            __doc__ = ("tf.GradientTape, patched by memsave.patch: computes with memsave.\n\n"
                       + (original.__doc__ or ""))
            memsave_original = original

            def __init__(self, persistent=False, watch_accessed_variables=True):
                with _lock:
                    setting = _active[-1][1] if _active else None
                super().__init__(persistent, watch_accessed_variables,
                                 *(setting or ("collection", False)))
                # Made while no patch is active (a subclass or a name imported while one
                # was): the plain tape.
                self._as_tape = setting is None

            @tf.autograph.experimental.do_not_convert
            def gradient(self, *args, **kwargs):
                if _in_memsave():
                    return original.gradient(self, *args, **kwargs)
                with _inside_memsave():
                    return super().gradient(*args, **kwargs)

        PatchedGradientTape.__name__ = PatchedGradientTape.__qualname__ = "GradientTape"
        _tape_classes[id(original)] = PatchedGradientTape
    return _tape_classes[id(original)]


def _uninstall():
    # Reverse order: a TFModuleWrapper is restored before the module it wraps.
    errors = []
    while _saved:
        owner, attribute, present, value = _saved.pop()
        try:
            if present:
                setattr(owner, attribute, value)
            elif attribute in vars(owner):
                delattr(owner, attribute)
        except (AttributeError, TypeError) as err:  # keep restoring the rest
            errors.append(f"{getattr(owner, '__name__', owner)}: {err}")
    _originals.clear()
    if errors:
        raise MemsaveError("could not restore every patched tf.gradients and tf.GradientTape: "
                           + "; ".join(errors)
                           + ". Restart the Python process to get a clean TensorFlow.")
    _log.debug("memsave.patch: restored the original gradients functions")


def original_gradients():
    """The un-patched `tf.gradients`, whether or not a patch is active.

    Returns:
      The function `tf.gradients` was before the outermost active patch (the
      current `tf.gradients` when none is active).
    """
    import tensorflow as tf
    with _lock:
        return _originals.get(id(tf), tf.gradients)


def active_checkpoints():
    """The strategy of the innermost active patch, or None when none is active."""
    with _lock:
        return _active[-1][1][0] if _active else None


class patch(contextlib.ContextDecorator):  # noqa: N801 -- used like a function
    """Routes tf.gradients & co. through memsave (context manager or decorator).

    Args:
      checkpoints: strategy for every patched call: 'collection', 'speed',
        'memory', or a list of tensors (or tensor names) to keep.
      offload: as for memsave.gradients (False, True, a device string or
        memsave.Offload).
    Raises:
      MemsaveError: if `checkpoints` names no strategy.

    Example:
        with memsave.patch(checkpoints='memory'):
            grads = tf.gradients(loss, params)           # memsave
            train_op = opt.minimize(loss)                 # memsave (v1 optimizer)
        grads = tf.gradients(loss, params)               # plain TF again
    """

    def __init__(self, checkpoints="collection", offload=False):
        self.checkpoints = check_checkpoints(checkpoints)
        offload_lib.normalise(offload)
        self.offload = offload
        self._tokens = []

    def __enter__(self):
        token = object()
        with _lock:
            if not _active:
                _install()
            _active.append((token, (self.checkpoints, self.offload)))
        self._tokens.append(token)
        return self

    def __exit__(self, exc_type, exc, tb):
        token = self._tokens.pop()
        with _lock:
            for i in range(len(_active) - 1, -1, -1):
                if _active[i][0] is token:
                    del _active[i]
                    break
            if not _active:
                _uninstall()
        return False

    def __repr__(self):
        return f"memsave.patch(checkpoints={self.checkpoints!r})"
