"""The input error of the LLM stack: weights, tokenizer, fetch, generation.

``treeattn.llm`` re-exports :class:`ModelError`, and the CLI turns it into one
``error: ...`` line with exit status 2.
"""

from treeattn.errors import TreeattnError


class ModelError(TreeattnError):
    """Bad model input: a missing, corrupt or unsupported model, or a bad generation request."""
