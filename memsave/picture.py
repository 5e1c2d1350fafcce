"""A picture of a step's memory: tf.gradients' live bytes over the step and the plan's,
as text for a terminal or as a PNG (matplotlib, the `bench` extra).

Drawn from a report's curves (memsave.planner.curves: the memory model's timeline, each
point the most bytes alive over the ops it stands for), in the words of TensorBoard's
memory profile: a timeline, its peak, and the allocations alive at the peak.

    report = memsave.last_report()
    print(report.picture())                  # or print(memsave.picture.text(report))
    report.save_picture("step.png", limit="8GiB")
"""

from memsave.errors import MemsaveError
from memsave.limits import parse_memory_limit

PLAN, BASELINE, BOTH, LIMIT = "#", ".", "#", "-"


def _mib(nbytes):
    return f"{nbytes / 2**20:.1f} MiB"


def _curves(report):
    plan, baseline = report.memory_curve, report.baseline_curve
    if plan is None or baseline is None:
        raise MemsaveError("this report has no memory timeline (plain tf.gradients answered "
                           "before memsave planned: see report.fallback)")
    return plan, baseline


def _resampled(values, width):
    """`values` in `width` columns, each the most of the values it stands for."""
    if not values:
        return [0] * width
    columns = []
    for column in range(width):
        start = column * len(values) // width
        end = max(start + 1, (column + 1) * len(values) // width)
        columns.append(max(values[start:end]))
    return columns


def text(report, width=72, height=12, limit=None):
    """The timeline as text: rows of bytes, '#' the plan's live bytes, '.' where only
    tf.gradients' reach, '-' the limit; then each curve's peak and what is alive at it.
    Each curve spans the width (the plan's step has more ops: its recomputation), so a
    column is the same share of each step, not the same op.

    Args:
      report: a memsave.RewriteReport.
      width, height: the chart's columns and rows.
      limit: bytes (or text such as "8GiB") to draw as a line, e.g. a budget.
    """
    plan, baseline = _curves(report)
    limit = None if limit is None else parse_memory_limit(limit)
    planned = _resampled(plan.live_bytes, width)
    plain = _resampled(baseline.live_bytes, width)
    top = max(max(plain), max(planned), limit or 0, 1)
    rows = []
    for row in range(height, 0, -1):
        floor = top * (row - 0.5) / height
        line = "".join(
            PLAN if p >= floor else BASELINE if b >= floor else " "
            for p, b in zip(planned, plain))
        if limit is not None and top * (row - 1) / height < limit <= top * row / height:
            line = "".join(LIMIT if c == " " else c for c in line)
        rows.append(f"{_mib(top * row / height):>11} |{line}")
    rows.append(" " * 12 + "+" + "-" * width)
    rows.append(" " * 13 + _phase_axis(plan, width))
    lines = [f"memsave: live memory over the step ({PLAN} memsave's plan, {BASELINE} tf.gradients"
             + (f", {LIMIT} the limit {_mib(limit)}" if limit is not None else "") + ")"]
    lines += rows
    held = {"memsave's plan": report.predicted_peak_bytes,
            "tf.gradients": report.baseline_peak_bytes}
    for name, curve in (("memsave's plan", plan), ("tf.gradients", baseline)):
        allocator = held[name]
        also = (f" (the allocator holds {_mib(allocator)}: the report's peak)"
                if allocator and allocator != curve.peak_bytes else "")
        lines.append(f"{name}: peak {_mib(curve.peak_bytes)} of live tensors{also}, "
                     f"at {curve.peak_at}")
        lines += [f"    {_mib(nbytes):>11}  {what}" for nbytes, what in curve.largest_at_peak]
    return "\n".join(lines)


def _phase_axis(curve, width):
    """A line under the chart marking where the plan's phases start ('|' and a name
    where there is room)."""
    axis = [" "] * width
    points = max(1, len(curve.live_bytes))
    for point, name in curve.phases:
        column = min(width - 1, point * width // points)
        label = "|" + name.replace("segment ", "s")
        if all(c == " " for c in axis[column:column + len(label)]):
            axis[column:column + len(label)] = list(label[:width - column])
        elif axis[column] == " ":
            axis[column] = "|"
    return "".join(axis)


def save_png(report, path, limit=None):
    """The timeline as a PNG at `path` (matplotlib; `pip install "memsave[bench]"`)."""
    plan, baseline = _curves(report)
    try:  # (a figure of its own: no pyplot, no backend switched under a notebook)
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise MemsaveError("a PNG picture needs matplotlib: pip install \"memsave[bench]\" "
                           "(or print report.picture() for text)") from e
    figure = Figure(figsize=(10, 4))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    for curve, label, style in ((baseline, "tf.gradients", "--"), (plan, "memsave's plan", "-")):
        share = [i / max(1, len(curve.live_bytes) - 1) for i in range(len(curve.live_bytes))]
        axes.plot(share, [b / 2**20 for b in curve.live_bytes], style,
                  label=f"{label} (peak {_mib(curve.peak_bytes)})")
    if limit is not None:
        axes.axhline(parse_memory_limit(limit) / 2**20, color="red", linewidth=1,
                     label=f"limit {_mib(parse_memory_limit(limit))}")
    for point, name in plan.phases:
        axes.axvline(point / max(1, len(plan.live_bytes) - 1), color="grey", linewidth=0.3)
    axes.set_xlabel("the step, from the forward pass to the last gradient (share of its ops)")
    axes.set_ylabel("live MiB")
    axes.set_title(f"memsave: live memory over the step (peak at {plan.peak_at})", fontsize=9)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    return path
