"""The most bytes alive at once among buffers that each live over a range of steps.

Read through the memory model's Timeline (memsave.planner.timeline), the one buffer
store of the step's simulation and of a gradient's replay apart (function_run), and by
MemoryModel.curve for the live bytes of every step.
"""


def live_per_step(starts, ends, sizes, steps):
    """Bytes alive at each step 0 .. steps - 1: buffer i holds sizes[i] bytes from step
    starts[i] through step ends[i] (an end past the last step counts as the last step).
    One difference-array pass."""
    diff = [0] * (steps + 1)
    for start, end, nbytes in zip(starts, ends, sizes):
        diff[start] += nbytes
        diff[min(end, steps - 1) + 1] -= nbytes
    live, running = [], 0
    for step in range(steps):
        running += diff[step]
        live.append(running)
    return live


def peak(starts, ends, sizes, steps):
    """(peak bytes, first step at which it is reached) over steps 0 .. steps - 1, of
    buffers as live_per_step's."""
    best, best_step = -1, 0
    for step, live in enumerate(live_per_step(starts, ends, sizes, steps)):
        if live > best:
            best, best_step = live, step
    return max(best, 0), best_step
