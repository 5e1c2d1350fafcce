"""How an op takes part in the training step (StepGraph.kind), apart from StepGraph so
that the modules StepGraph.build calls (memsave.planner.deferral,
memsave.planner.buffer_links) can read them without importing it."""

RESIDENT = 0    # no inputs: constants, placeholders, captured inputs, variable handles;
                # or folded into a constant by Grappler (memsave.planner.constant_folding)
REGION = 1      # on the path from xs to ys and recomputable
KEPT = 2        # on the path but never recomputed (stateful, control flow, an x's own op)
FORWARD = 3     # forward only: does not depend on the xs
