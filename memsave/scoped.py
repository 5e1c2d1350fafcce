"""Values a `with` block gives the gradients calls traced inside it.

Innermost first, restored on exit; a thread with none of its own sees the latest
active in any thread: tf.distribute traces each replica's step in a thread of its own,
inside the `fit` (or the `with` block) of another.
"""

import contextlib
import threading


class ScopedValues:
    """A stack of values per thread, with the latest of any thread as a fallback."""

    def __init__(self):
        self._local = threading.local()
        self._any_thread = []
        self._lock = threading.Lock()

    def _stack(self):
        if not hasattr(self._local, "stack"):
            self._local.stack = []
        return self._local.stack

    @contextlib.contextmanager
    def active(self, value):
        """Makes `value` the current one inside the block."""
        entry = [value]  # (a list: found again by identity, equal values or not)
        self._stack().append(entry)
        with self._lock:
            self._any_thread.append(entry)
        try:
            yield value
        finally:
            self._stack().pop()
            with self._lock:
                # This entry, not the last: another thread's may have come after it.
                del self._any_thread[max(i for i, e in enumerate(self._any_thread)
                                         if e is entry)]

    def current(self):
        """This thread's innermost active value; where it has none, the latest active in
        any thread; None where none is active."""
        stack = self._stack()
        if stack:
            return stack[-1][0]
        with self._lock:
            return self._any_thread[-1][0] if self._any_thread else None
