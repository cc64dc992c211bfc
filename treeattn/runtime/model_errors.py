"""The input error of the model side of the runtime: weights, tokenizer, fetch, generation.

``treeattn.runtime`` re-exports :class:`ModelError`, and the CLI turns it into one
``error: ...`` line with exit status 2.
"""


class ModelError(Exception):
    """Bad model input: a missing, corrupt or unsupported model, or a bad generation request."""
