"""The base of every error treeattn raises on purpose, and the error for bad user input that
is not owned by one package.

Every package's error derives from :class:`TreeattnError` (``topo.TopologyError``,
``schedule.SimError``, ``kernels.KernelError``, ``runtime.RuntimeFailure``,
``llm.ModelError``, ``hf.HFIntegrationError``, :class:`UserError`), so a caller catches
``treeattn.TreeattnError`` for all of them, and the CLI and the rank launcher turn it into one
``error:`` line. This module imports nothing, so that every layer (``topo`` included) may
build on it.
"""

from __future__ import annotations


class TreeattnError(Exception):
    """Something treeattn refused or could not do; the message is one line naming the cause.

    The errors about bad values also derive from :class:`ValueError` (``TopologyError``,
    ``SimError``, ``KernelError``), so code written against ``ValueError`` keeps working.
    """


class UserError(TreeattnError):
    """Bad input from the user: a one-line message that names the problem."""
