"""The allocator's peak of each of several training steps, one by one, in one process.

    python benchmarks/step_peaks.py --model calls --strategy memory --steps 5
    python benchmarks/step_peaks.py --model unet --strategy memory --processes 3

compare.py measures the highest peak over a few steps; this shows how much the peak
of the same plan moves from step to step (the executor's order, and where the BFC
allocator places each buffer), beside the memory model's prediction. Each process
(`memsave.measure.run_isolated`, BFC allocator on) traces the tf.function step once,
then resets the allocator's peak before each step and reads it after.
"""

import argparse
import os
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from benchmarks import compare  # noqa: E402
from memsave import measure  # noqa: E402

CHILD_TARGET = "benchmarks.step_peaks:measure_steps"
MiB = 2**20


def measure_steps(model="cnn", strategy="memory", steps=5, seed=0, model_options=None):
    """Child side: {"peaks": [peak bytes of each step], "predicted": the peak memsave
    predicted (tf.gradients': the model's prediction of it)}."""
    import tensorflow as tf

    import memsave
    from benchmarks.models import build_model

    bench = build_model(model, seed=seed, **(model_options or {}))
    grad_fn, timings = compare._strategy_gradient_fn(strategy, bench)
    step = bench.make_step(grad_fn)
    inputs = [measure.device_input(array) for array in bench.inputs]
    step.get_concrete_function(*inputs)
    report = None if strategy == compare.BASELINE else memsave.last_report()
    predicted = (timings.get("predicted_peak_bytes") if report is None
                 else report.predicted_peak_bytes)
    device = measure.memory_device()

    def run_step():
        step(*inputs)
        measure.sync_devices()

    peaks = [measure.peak_memory_bytes(run_step, device)[0] for _ in range(steps)]
    return {"peaks": peaks, "predicted": predicted}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="cnn", choices=compare.MODELS)
    parser.add_argument("--strategy", default="memory",
                        help="tf.gradients or a strategy as compare.py names it")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--timeout", type=int, default=1200)
    args = parser.parse_args(argv)
    results = [measure.run_isolated(CHILD_TARGET, timeout=args.timeout, model=args.model,
                                    strategy=args.strategy, steps=args.steps)
               for _ in range(args.processes)]
    print(f"{args.model} / {args.strategy}, peak of each step (MiB; "
          f"{measure.device_description()}):")
    for i, result in enumerate(results):
        print(f"  process {i + 1}: " + " ".join(f"{p / MiB:.1f}" for p in result["peaks"]))
    peaks = [p for result in results for p in result["peaks"]]
    predicted = results[0]["predicted"]
    line = f"  lowest {min(peaks) / MiB:.1f}, highest {max(peaks) / MiB:.1f}"
    if predicted:
        line += (f"; predicted {predicted / MiB:.1f} ({predicted / max(peaks) - 1:+.0%} of the "
                 f"highest, {predicted / min(peaks) - 1:+.0%} of the lowest)")
    print(line)
    return results


if __name__ == "__main__":
    main()
