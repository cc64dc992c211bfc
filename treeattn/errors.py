"""The error for bad user input that is not owned by one package, and the list of all of them.

Packages keep their own input errors (``topo.TopologyError`` and friends) so that ``topo``
imports nothing of ours; the CLI and the rank launcher catch all of them and print one line.
"""

from __future__ import annotations

import sys

# (module, class) of every package's input error, looked up only when already imported.
PACKAGE_ERRORS = (
    ("treeattn.topo", "TopologyError"),
    ("treeattn.sim", "SimError"),
    ("treeattn.kernels", "KernelError"),
    ("treeattn.runtime", "RuntimeFailure"),
    ("treeattn.llm", "ModelError"),
)


class UserError(Exception):
    """Bad input from the user: a one-line message that names the problem."""


def user_error_types() -> tuple[type[BaseException], ...]:
    """Every exception type that means "the input was bad".

    Only packages already imported are asked: an error can only come from one of those, and
    asking this way imports nothing (``treeattn.runtime`` must not import ``treeattn.llm``).
    """
    found: list[type[BaseException]] = [UserError]
    for module_name, class_name in PACKAGE_ERRORS:
        error_type = getattr(sys.modules.get(module_name), class_name, None)
        if isinstance(error_type, type) and issubclass(error_type, BaseException):
            found.append(error_type)
    return tuple(found)
