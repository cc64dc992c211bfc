"""The error raised by the kernels for bad input (shapes, dtypes, devices, backend choice)."""


class KernelError(ValueError):
    """Bad kernel input: a wrong shape, dtype or device, or a backend that cannot run here."""
