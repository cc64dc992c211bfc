"""The error raised by the kernels for bad input (shapes, dtypes, devices, backend choice)."""

from treeattn.errors import TreeattnError


class KernelError(TreeattnError, ValueError):
    """Bad kernel input: a wrong shape, dtype or device, or a backend that cannot run here."""
