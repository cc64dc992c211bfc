"""Render a model's chat template with bounded work, memory and time.

Chat templates are Jinja code that comes with the model file, so they run in jinja2's
immutable sandbox: no attribute tricks, no mutation. The sandbox does not bound *work*,
though: two nested ``range(100000)`` loops, a string doubled in a loop or ``'x' * 10**10``
exhaust memory or run for minutes. :class:`BoundedSandbox` caps

* loop iterations drawn from ``range`` (all ranges of one render together),
* the size of any string or list built by ``+``, ``*`` and of any ``**`` result,
* the rendered text's length (rendered as a stream and measured as it grows),
* wall-clock time (``SIGALRM`` on the main thread, which interrupts any Python loop),

and any breach ends in one :class:`ModelError` line. Real templates use a handful of
iterations and a few kilobytes; the caps are orders of magnitude above that.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from treeattn.llm.errors import ModelError

MAX_ITERATIONS = 100_000  # range() items per render
MAX_CHARS = 1_000_000  # rendered text, and any string or list built on the way
MAX_SECONDS = 5.0


class TemplateBudget(TemplateError):
    """The template did more work than a chat prompt can need."""


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """An immutable sandbox whose ``range``, ``+``, ``*`` and ``**`` are bounded."""

    intercepted_binops = frozenset(["+", "*", "**"])

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.iterations = 0
        self.globals["range"] = self._range

    def _range(self, *args):
        items = range(*args)
        self.iterations += len(items)
        if self.iterations > MAX_ITERATIONS:
            raise TemplateBudget(f"it loops over more than {MAX_ITERATIONS} range() items")
        return items

    def call_binop(self, context, operator, left, right):
        if operator == "**" and isinstance(right, int) and abs(right) > 1024:
            raise TemplateBudget(f"it raises to the power {right}")
        if operator == "*":
            sized = [x for x in (left, right) if isinstance(x, (str, list, tuple))]
            count = next((x for x in (left, right) if isinstance(x, int)), 1)
            if sized and len(sized[0]) * count > MAX_CHARS:
                raise TemplateBudget(f"it builds a value longer than {MAX_CHARS}")
        result = super().call_binop(context, operator, left, right)
        if isinstance(result, (str, list, tuple)) and len(result) > MAX_CHARS:
            raise TemplateBudget(f"it builds a value longer than {MAX_CHARS}")
        return result


@contextmanager
def _time_limit(seconds: float):
    """Raise TemplateBudget in the main thread after ``seconds`` (no-op elsewhere)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(
            signal, "setitimer"):
        yield
        return

    def expire(signum, frame):
        raise TemplateBudget(f"it ran for more than {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def render_chat_template(template: str, **variables) -> str:
    """Render ``template`` with ``variables`` within the budgets; ModelError on failure."""

    def raise_exception(message):
        raise TemplateError(message)

    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    parts: list[str] = []
    size = 0
    try:
        with _time_limit(MAX_SECONDS):
            for chunk in env.from_string(template).generate(**variables):
                size += len(chunk)
                if size > MAX_CHARS:
                    raise TemplateBudget(f"its output exceeds {MAX_CHARS} characters")
                parts.append(chunk)
    except TemplateBudget as exc:
        raise ModelError(f"the model's chat template does too much work: {exc}") from None
    except TemplateError as exc:
        raise ModelError(f"the model's chat template failed: {exc}") from None
    except (MemoryError, RecursionError, OverflowError) as exc:
        raise ModelError(f"the model's chat template does too much work: "
                         f"{type(exc).__name__}") from None
    return "".join(parts)
