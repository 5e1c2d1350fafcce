"""STUB"""
CHECKPOINT_COLLECTION = "checkpoints"
STRATEGIES = {}


def mark_checkpoint(t):
    t.graph.add_to_collection(CHECKPOINT_COLLECTION, t)
    return t
