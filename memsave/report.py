"""What a rewrite kept, what it recomputes, and how big those are.

`memsave.gradients` records a RewriteReport for every call; `last_report()`
returns the latest, and `memsave.plan(...)` builds one without touching the
graph. The same facts go to the 'memsave' logger at INFO (summary) and DEBUG
(every checkpoint and segment).
"""

import dataclasses
import logging
import threading
from typing import List, Optional, Tuple

from memsave.region import estimated_bytes

logger = logging.getLogger(__name__)
_latest = threading.local()


@dataclasses.dataclass
class CheckpointInfo:
    """One kept tensor."""
    name: str
    shape: str
    dtype: str
    bytes: int
    reason: str

    @classmethod
    def of(cls, t, reason):
        return cls(t.name, str(t.shape), t.dtype.name, estimated_bytes(t), reason)


@dataclasses.dataclass
class SegmentInfo:
    """One recomputed segment: the tensors it ends at and what it copies."""
    ends_at: List[str]
    copied_ops: int
    recomputed_bytes: int


@dataclasses.dataclass
class RewriteReport:
    """What memsave chose for one gradients call.

    Sizes are static estimates (unknown dimensions count as 1).
    """
    strategy: str
    region_ops: int
    checkpoints: List[CheckpointInfo] = dataclasses.field(default_factory=list)
    dropped: List[Tuple[str, str]] = dataclasses.field(default_factory=list)
    not_recomputable: List[Tuple[str, str]] = dataclasses.field(default_factory=list)
    segments: List[SegmentInfo] = dataclasses.field(default_factory=list)
    fallback: Optional[str] = None

    @property
    def kept_bytes(self):
        return sum(c.bytes for c in self.checkpoints)

    @property
    def copied_ops(self):
        return sum(s.copied_ops for s in self.segments)

    @property
    def recomputed_bytes(self):
        return sum(s.recomputed_bytes for s in self.segments)

    def summary(self):
        if self.fallback:
            return f"memsave: plain tf.gradients used ({self.fallback})"
        return (f"memsave: strategy {self.strategy}: {len(self.checkpoints)} checkpoints "
                f"({_mb(self.kept_bytes)} kept) over a region of {self.region_ops} ops; "
                f"{len(self.segments)} segments recompute {self.copied_ops} ops "
                f"({_mb(self.recomputed_bytes)}); {len(self.not_recomputable)} ops kept as "
                "not recomputable")

    def format(self):
        """A readable table of checkpoints and segments."""
        lines = [self.summary(), "", "kept (checkpoints):"]
        lines += [f"  {c.name:<48} {c.shape:<20} {c.dtype:<8} {_mb(c.bytes):>10}  {c.reason}"
                  for c in self.checkpoints]
        if self.dropped:
            lines += ["dropped from the checkpoint list:"]
            lines += [f"  {name}: {why}" for name, why in self.dropped]
        if self.not_recomputable:
            lines += ["not recomputable (outputs kept, never re-run):"]
            lines += [f"  {name}: {why}" for name, why in self.not_recomputable]
        if self.segments:
            lines += ["recomputed segments (in backward order):"]
            lines += [f"  ends at {', '.join(s.ends_at)[:60]:<60} {s.copied_ops:>5} ops "
                      f"{_mb(s.recomputed_bytes):>10}" for s in self.segments]
        return "\n".join(lines)

    __str__ = format

    def log(self):
        logger.info("%s", self.summary())
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("%s", self.format())


def _mb(n):
    return f"{n / 2**20:.2f} MB"


def record(report):
    """Makes `report` the one `last_report()` returns (per thread) and logs it."""
    _latest.report = report
    report.log()
    return report


def last_report():
    """The RewriteReport of the latest memsave.gradients call in this thread, or None."""
    return getattr(_latest, "report", None)
