"""The one exception class memsave raises for bad input and unsupported graphs."""

MESSAGE_PREFIX = "memsave: "
DEBUG_HINT = ("(for details of what memsave chose, enable logging: "
              "logging.getLogger('memsave').setLevel(logging.DEBUG))")


class MemsaveError(ValueError):
    """Raised for bad input or a graph memsave cannot rewrite.

    Messages start with ``memsave:``, name the bad value and say what to do
    instead. It subclasses ValueError so existing ``except ValueError`` code that
    wrapped ``tf.gradients`` keeps working.
    """

    def __init__(self, message, hint=None):
        if not message.startswith(MESSAGE_PREFIX):
            message = MESSAGE_PREFIX + message
        if hint:
            message = f"{message} {hint}"
        super().__init__(message)


class MemsaveWarning(UserWarning):
    """Warned when memsave changes what the user asked for (e.g. drops a checkpoint)."""
