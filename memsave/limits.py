"""Memory limits as users write them: bytes, or text such as "8GiB"."""

import numbers
import re

from memsave.errors import MemsaveError

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_LIMIT_TEXT = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]i?b|b)?\s*$", re.IGNORECASE)


def parse_memory_limit(limit):
    """Bytes of a memory limit given as an int or as text ("8GiB", "512 MiB", "16GB").

    Raises:
      MemsaveError: for anything else, or a limit that is not positive.
    """
    if isinstance(limit, numbers.Integral) and not isinstance(limit, bool) and limit > 0:
        return int(limit)
    if isinstance(limit, float) and limit >= 1:
        return int(limit)
    if isinstance(limit, str):
        match = _LIMIT_TEXT.match(limit)
        if match:
            nbytes = int(float(match.group(1)) * _UNITS[(match.group(2) or "").lower()])
            if nbytes > 0:
                return nbytes
    hint = (" (a fraction of a device is not a limit: pass its bytes, and headroom= for "
            "the share to leave free)" if isinstance(limit, float) and 0 < limit < 1 else "")
    raise MemsaveError(f"memory_limit is {limit!r}; pass a positive number of bytes or text "
                       f"such as '8GiB', '512MiB' or '16GB'{hint}")
