"""Checkpoint and tokenizer formats, and getting a model onto the ranks.

GGUF read and dequantized (:mod:`~treeattn.llm.formats.gguf_load`,
:mod:`~treeattn.llm.formats.gguf_quants`), a model loaded by name, GGUF or Hugging Face folder
(:mod:`~treeattn.llm.formats.weights`), the tokenizer and chat template, the default model's
fetch, and the per-run snapshot the ranks map.
"""
