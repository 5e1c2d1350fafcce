"""Which variant of a chosen plan runs: whether its segments read their checkpoints or
recompute them, whether they recompute ahead, and whether its last segment reads the
forward pass; each decided by the memory model's prediction of the plan both ways
(memsave.planning asks `final_prediction` once the strategy has chosen the checkpoints).
"""

# A plan reads its checkpoints, or recomputes ahead, where the strategy did not decide
# and that raises its predicted peak by at most this much.
_FREE_PEAK_TOLERANCE = 0.01


def final_prediction(model, environment, selection, checkpoints, offloaded, options):
    """The prediction of the chosen plan: whether its segments read their checkpoints
    (_reading_or_recomputing), whether they recompute ahead (_ahead_or_not), and
    whether its last segment is read from the forward pass: as the strategy chose (a
    budget searches plans reading it), or, where it did not choose, as
    _last_segment_read_or_recomputed decides."""
    chosen_last = selection.read_last_segment
    read_last = bool(chosen_last) and environment.may_read_last_segment
    prediction = _reading_or_recomputing(model, environment, selection.read_checkpoints,
                                         checkpoints, offloaded, options, read_last)
    prediction = _ahead_or_not(model, environment, selection.recompute_ahead, checkpoints,
                               offloaded, prediction)
    if chosen_last is not None or not environment.may_read_last_segment:
        return prediction
    return _last_segment_read_or_recomputed(model, checkpoints, offloaded, options, prediction)


def _last_segment_read_or_recomputed(model, checkpoints, offloaded, options, prediction):
    """`prediction`, or that of the same plan whose last segment's gradients read its
    tensors as the forward pass made them (MemoryModel.predict's read_last_segment)
    where that recomputes less and predicts no higher peak (the plan's, as its strategy
    checked it: 'memory''s lowest peak; a budget chose already): the last segment's backward
    pass starts as the forward pass ends, so its recomputation would make again what
    is still there, unless forward ops that run after it (a side branch feeding the
    loss) hold the peak."""
    extra = (options.prefetch, options.flops_per_byte) if offloaded else ()
    flags = prediction.flags(read_last_segment=True)
    reading = model.predict(checkpoints, offloaded, *extra, **flags)
    if (reading.cost_flops >= prediction.cost_flops
            or reading.peak_bytes > prediction.peak_bytes):
        return prediction
    reading = model.predict(checkpoints, offloaded, *extra, allocator=True, **flags)
    return reading if reading.device_peak_bytes <= prediction.device_peak_bytes else prediction


def _ahead_or_not(model, environment, chosen, checkpoints, offloaded, prediction):
    """`prediction`, or that of the same plan recomputing ahead (MemoryModel.predict's
    recompute_ahead: each segment's recomputation runs beside the backward pass of the
    segment after it, so it leaves the critical path where the executor runs ops side
    by side): where the strategy chose so (`chosen`, a budget, where it fits), or, where
    it did not choose, if the predicted peak stays within _FREE_PEAK_TOLERANCE.

    Not with offloaded checkpoints (their copies back are timed by the segments'
    triggers) nor under XLA (Environment.may_recompute_ahead)."""
    if chosen is False or offloaded or not environment.may_recompute_ahead:
        return prediction
    within = 1 + _FREE_PEAK_TOLERANCE
    flags = prediction.flags(recompute_ahead=True)
    if not chosen:  # (live tensors first: the allocator's replay only if they qualify)
        ahead = model.predict(checkpoints, **flags)
        if ahead.peak_bytes > prediction.peak_bytes * within:
            return prediction
    ahead = model.predict(checkpoints, allocator=True, **flags)
    if chosen or ahead.device_peak_bytes <= prediction.device_peak_bytes * within:
        return ahead
    return prediction


def _reading_or_recomputing(model, environment, chosen, checkpoints, offloaded, options,
                            read_last_segment):
    """The prediction of the chosen plan (its last segment read where
    `read_last_segment`), its segments reading or recomputing the checkpoint each ends
    at (Prediction.reads_checkpoints).

    Its segments read their checkpoints as the forward pass made them where they may
    (Environment.may_read_checkpoints) and the strategy chose so (`chosen`: a budget
    searches both kinds of plan), or, where it did not choose, if that recomputes less
    and keeps the predicted peak within _FREE_PEAK_TOLERANCE of recomputing them:
    reading holds each checkpoint through the later segment's backward pass, and a
    segment ending at a ReLU then runs nothing."""
    extra = (options.prefetch, options.flops_per_byte) if offloaded else ()
    last = dict(read_last_segment=read_last_segment)
    recomputing = model.predict(checkpoints, offloaded, *extra, allocator=True, **last)
    if chosen is False or not environment.may_read_checkpoints:
        return recomputing
    graph = model.graph
    if not chosen and not any(c in graph.grad_reads[graph.producer[c]] for c in checkpoints):
        return recomputing  # no checkpoint's own gradient reads it: nothing to gain
    within = 1 + _FREE_PEAK_TOLERANCE
    if not chosen:  # (live tensors first: the allocator's replay only if they qualify)
        reading = model.predict(checkpoints, offloaded, *extra, read_checkpoints=True, **last)
        if (reading.cost_flops >= recomputing.cost_flops
                or reading.peak_bytes > recomputing.peak_bytes * within):
            return recomputing
    reading = model.predict(checkpoints, offloaded, *extra, allocator=True,
                            read_checkpoints=True, **last)
    if chosen or reading.device_peak_bytes <= recomputing.device_peak_bytes * within:
        return reading
    return recomputing
