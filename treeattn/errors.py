"""The error for bad user input that is not owned by one package.

Packages keep their own input errors (``topo.TopologyError`` and friends) so that ``topo``
imports nothing of ours; the CLI catches all of them and prints one line.
"""


class UserError(Exception):
    """Bad input from the user: a one-line message that names the problem."""
