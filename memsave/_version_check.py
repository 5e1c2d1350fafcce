"""TensorFlow is a requirement memsave cannot name in install_requires (see setup.cfg),
so it checks, once, when imported."""

MIN_TENSORFLOW = (2, 16)
INSTALL_HINT = ("install one TensorFlow distribution, e.g. `pip install memsave[cpu]` "
                "(tensorflow-cpu), `memsave[tensorflow]`, or `memsave[gpu]` (tensorflow[and-cuda])")


def _parse(version):
    parts = []
    for piece in version.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def check_tensorflow_version():
    """Raises ImportError with an install hint if TensorFlow is missing or too old."""
    try:
        import tensorflow as tf
    except ImportError as error:
        raise ImportError(f"memsave: TensorFlow is not installed; {INSTALL_HINT}") from error
    if _parse(tf.__version__) < MIN_TENSORFLOW:
        raise ImportError(f"memsave: needs TensorFlow >= {'.'.join(map(str, MIN_TENSORFLOW))}, "
                          f"found {tf.__version__}; {INSTALL_HINT}")
