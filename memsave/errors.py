"""The one exception class memsave raises, and the warning it gives.

Where `tf.gradients` itself refuses an input, memsave refuses it too, before any
op is added, with its own message but the exception type `tf.gradients` raises
(a MemsaveError that is also a TypeError, AttributeError or RuntimeError), so
code written around `tf.gradients` catches what it caught before.
"""

MESSAGE_PREFIX = "memsave: "
_AUTOGRAPH_TRACE = "in user code:"
DEBUG_HINT = ("(for details of what memsave chose, enable logging: "
              "logging.getLogger('memsave').setLevel(logging.DEBUG))")


class MemsaveError(ValueError):
    """Raised for bad input or a graph memsave cannot rewrite.

    Messages start with ``memsave:``, name the bad value and say what to do
    instead. It subclasses ValueError (what tf.gradients raises for most bad
    input); the subclasses below also carry the other types tf.gradients raises.
    """

    def __str__(self):
        message = super().__str__()
        # (AutoGraph's re-raised copy leads with its trace: the prefix is inside.)
        if message.startswith((MESSAGE_PREFIX, _AUTOGRAPH_TRACE)):
            return message
        return MESSAGE_PREFIX + message


# AutoGraph re-raises an error from inside a tf.function as its own type only where that
# type is built as Exception is (from the message alone); any other becomes a StagingError
# that `except memsave.MemsaveError` (or ValueError) does not catch. So no __init__ of
# its own: the prefix is added when the message is read.
MemsaveError.__init__ = Exception.__init__


class MemsaveTypeError(MemsaveError, TypeError):
    """Bad input for which tf.gradients raises a TypeError (wrong kind or dtype of value)."""


class MemsaveAttributeError(MemsaveError, AttributeError):
    """Bad input for which tf.gradients raises an AttributeError (None, or no tensor, where it
    reads `.op`)."""


class MemsaveRuntimeError(MemsaveError, RuntimeError):
    """Called where tf.gradients raises a RuntimeError (eagerly, outside any graph)."""


class MemsaveWarning(UserWarning):
    """Warned when memsave changes what the user asked for (e.g. drops a checkpoint)."""
