"""'collection': keep the tensors the user marked in a graph collection."""

from memsave.graph.select import TensorSet
from memsave.strategies.base import keep_if

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
    def is_marked(t, region):
        marked = region.cache.get(("collection", name))
        if marked is None:
            marked = TensorSet(m for m in t.graph.get_collection(name) if hasattr(m, "op"))
            region.cache[("collection", name)] = marked
        return t in marked
    return keep_if(is_marked, f"in graph collection '{name}'")
