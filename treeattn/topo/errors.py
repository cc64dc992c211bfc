"""The one error type of :mod:`treeattn.topo`: bad topology input."""

from treeattn.errors import TreeattnError


class TopologyError(TreeattnError, ValueError):
    """A topology, spec string or tool output is invalid.

    The message is one line and names the offending node, edge, parameter or file.
    """
