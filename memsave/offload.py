"""Host offload of checkpoints: out after the forward pass, back just before the backward needs them.

Besides recomputation, the other lever of memory-saving gradients: a kept tensor
(a checkpoint) need not stay in accelerator memory between the forward pass, which
makes it, and the backward pass, which reads it. For each offloaded checkpoint the
rewrite adds

- a copy *out*, on the host, that reads the checkpoint as soon as it exists, so
  the accelerator's copy is freed once its forward readers are done;
- per segment that reads it, a copy *back*: a second host-side copy that waits
  (control input) for the backward op a prefetch distance ahead of the segment,
  then the copy onto the checkpoint's device that the segment reads instead.

Why this shape (see how TensorFlow moves tensors between devices: a cross-device
edge becomes a `_Send`/`_Recv` pair, and a `_Recv` runs as soon as the data is
sent): gating the device-side copy would not help, since its `_Recv` would bring
the tensor back the moment the host copy exists. The host-side gated copy holds
the data on the host until the prefetch point. The copies are `Snapshot` ops:
Grappler removes `Identity` pairs it thinks useless (even across devices), not
`Snapshot`s.

Which checkpoints are offloaded: with a checkpoint list or a strategy, every
checkpoint of at least `min_bytes` on another device than the host; with
`memsave.budget(limit, offload=...)`, the ones the planner chose, where moving
them costs less than recomputing what keeping them saves (the transfer cost is
`Offload.flops_per_byte`; memsave.planner.costs.transfer_flops).

Under XLA, device placement inside the compiled cluster is ignored, so nothing
is offloaded there (with a MemsaveWarning).
"""

import dataclasses
import numbers
import warnings
from typing import Optional

import tensorflow as tf

from memsave.errors import MemsaveError, MemsaveWarning
from memsave.planner.costs import DEFAULT_FLOPS_PER_BYTE, DEFAULT_MIN_BYTES, DEFAULT_PREFETCH
from memsave.region import estimated_bytes



@dataclasses.dataclass(frozen=True)
class Offload:
    """What to offload where. Pass as `offload=` (True is `Offload()`, a device string
    is `Offload(device=...)`).

    Args:
      device: where offloaded checkpoints wait: a device string, or None for the
        host memory of each checkpoint's device (`/CPU:0` of its job and task).
      min_bytes: checkpoints smaller than this stay where they are (default 1 MiB:
        a transfer costs a fixed latency, small tensors save little).
      prefetch: how many segments ahead of the one that reads a checkpoint its copy
        back may start (0: when that segment's own gradient is ready; default 1:
        while the previous segment's backward runs, so the transfer overlaps it).
      flops_per_byte: what moving one byte to the host costs, in FLOPs of the device
        (its FLOP rate over the host link's bandwidth; default 1000, a PCIe-attached
        data-centre GPU). Only `memsave.budget` weighs it, against recomputation.
    """
    device: Optional[str] = None
    min_bytes: int = DEFAULT_MIN_BYTES
    prefetch: int = DEFAULT_PREFETCH
    flops_per_byte: float = DEFAULT_FLOPS_PER_BYTE

    def __post_init__(self):
        if self.device is not None and not isinstance(self.device, str):
            raise MemsaveError(f"offload device is {self.device!r}; pass a device string such "
                               "as '/CPU:0', or None for the host of each checkpoint's device")
        for name in ("min_bytes", "prefetch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
                raise MemsaveError(f"offload {name} is {value!r}; pass an int >= 0")
        value = self.flops_per_byte
        if (isinstance(value, bool) or not isinstance(value, numbers.Real)
                or not 0 <= value < float("inf")):
            raise MemsaveError(f"offload flops_per_byte is {value!r}; pass a number >= 0 (the "
                               "device's FLOP/s over its host link's bytes/s, e.g. 1000)")


def normalise(offload):
    """The `offload=` argument as an Offload, or None for no offload.

    Raises:
      MemsaveError: for anything but False/None, True, a device string or an Offload.
    """
    if offload is None or offload is False:
        return None
    if offload is True:
        return Offload()
    if isinstance(offload, str):
        try:
            tf.DeviceSpec.from_string(offload)
        except ValueError as error:
            raise MemsaveError(f"offload={offload!r} is no device string; pass e.g. '/CPU:0', "
                               "True (the host of each checkpoint's device) or False") from error
        return Offload(device=offload)
    if isinstance(offload, Offload):
        return offload
    raise MemsaveError(f"offload is a {type(offload).__name__}; pass False, True, a device "
                       "string such as '/CPU:0', or memsave.Offload(...)")


def host_of(device):
    """The host (CPU:0) of the job and task of `device` ('' or None: this task's CPU:0)."""
    spec = tf.DeviceSpec.from_string(device or "")
    return spec.replace(device_type="CPU", device_index=0).to_string()


def usable(options, environment):
    """`options` (an Offload or None) where offload can happen in `environment`, else
    None: under XLA, which places the whole compiled step on one device, with a warning.
    """
    if options is not None and environment.under_xla:
        warnings.warn("memsave: offload is ignored under XLA (jit_compile): XLA places the "
                      "whole compiled step on one device, so checkpoints stay where they are",
                      MemsaveWarning, stacklevel=5)
        return None
    return options


def may_offload(t, options, accelerator, unknown_dim_size=1):
    """Whether checkpoint `t` could be offloaded under `options` (an Offload or None):
    large enough (its unknown dimensions sized as the plan sizes them,
    `unknown_dim_size`), and on another device than the one it would wait on. A
    checkpoint TensorFlow places itself (no device set) is on an accelerator only if
    there is one (`accelerator`)."""
    if options is None or estimated_bytes(t, unknown_dim_size) < options.min_bytes:
        return False
    if not t.op.device and options.device is None:
        return accelerator
    return _canonical(_host(t, options)) != _canonical(t.op.device)


def _host(t, options):
    return options.device or host_of(t.op.device)


class Offloader:
    """The copies of one rewrite: one copy out per offloaded checkpoint, one copy back
    per segment that reads it (the plan says which: memsave.planning.Plan.offloaded).
    `moved_bytes` sizes unknown dimensions as `unknown_dim_size` (the plan's)."""

    def __init__(self, options, unknown_dim_size=1):
        self.options = options
        self.unknown_dim_size = unknown_dim_size
        self._out = {}  # checkpoint name -> host copy
        self.moved_bytes = 0

    def copy_out(self, t):
        """The host copy of checkpoint `t` (made once, as soon as `t` exists)."""
        if t.name not in self._out:
            with _uncolocated(), tf.device(_host(t, self.options)):
                self._out[t.name] = tf.raw_ops.Snapshot(input=t, name="offload_out")
            self.moved_bytes += estimated_bytes(t, self.unknown_dim_size)
        return self._out[t.name]

    def copy_back(self, t, wait_for):
        """A copy of `t` on its own device that leaves the host only after the ops `wait_for`
        (a segment's trigger: memsave.ordering.done_ops, so never a call)."""
        host_copy = self.copy_out(t)
        with _uncolocated(), tf.device(_host(t, self.options)), tf.control_dependencies(wait_for):
            staged = tf.raw_ops.Snapshot(input=host_copy, name="offload_staged")
        graph = tf.compat.v1.get_default_graph()
        with graph.colocate_with(t.op, ignore_existing=True):
            back = tf.raw_ops.Snapshot(input=staged, name="offload_back")
        self.moved_bytes += estimated_bytes(t, self.unknown_dim_size)
        return back


def _uncolocated():
    """No colocation for the host copies: colocation would pull them onto the checkpoint's
    device (e.g. under the colocation tf.gradients puts around gradient code)."""
    return tf.compat.v1.get_default_graph().colocate_with(None, ignore_existing=True)


def _canonical(device):
    spec = tf.DeviceSpec.from_string(device)
    return (spec.job, spec.replica, spec.task, (spec.device_type or "").upper(), spec.device_index)
