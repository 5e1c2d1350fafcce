"""'collection': keep the tensors the user marked in a graph collection."""

from memsave.graph.select import TensorSet
from memsave.strategies.base import Choice

CHECKPOINT_COLLECTION = "checkpoints"


def mark_checkpoint(t, collection=CHECKPOINT_COLLECTION):
    """Marks tensor `t` as a checkpoint for the 'collection' strategy and returns it.

    Works in tf.compat.v1 graphs and inside tf.function bodies (the mark goes
    into the collection of `t`'s own graph), so it can be used inline:
    `h = memsave.mark_checkpoint(tf.nn.relu(h))`.
    """
    t.graph.add_to_collection(collection, t)
    return t


def marked_tensors(name=CHECKPOINT_COLLECTION):
    """A strategy keeping the region tensors found in graph collection `name`."""
    reason = f"in graph collection '{name}'"

    def strategy(region):
        graph = region.ys[0].graph
        marked = TensorSet(m for m in graph.get_collection(name) if hasattr(m, "op"))
        return [Choice(t, reason) for t in region.tensors() if t in marked]
    strategy.__name__ = f"marked_tensors({name!r})"
    return strategy
