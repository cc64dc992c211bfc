"""The LLM stack: a real Llama-family model decoding on a KV cache sharded across ranks.

- :mod:`treeattn.llm.model`: the transformer, with pluggable attention over the KV cache.
- :mod:`treeattn.llm.formats`: checkpoints and tokenizers.
  :mod:`~treeattn.llm.formats.weights` loads a model by name, GGUF file or Hugging Face
  directory (both formats are assembled by :func:`treeattn.llm.model.assemble`);
  :mod:`~treeattn.llm.formats.gguf_load` and :mod:`~treeattn.llm.formats.gguf_quants` read
  and dequantize GGUF, :mod:`~treeattn.llm.formats.snapshot` hands a loaded model to the
  ranks of one run, :mod:`~treeattn.llm.formats.fetch` downloads the default model and
  :mod:`~treeattn.llm.formats.tokenizer` wraps the tokenizer and its chat template.
- :mod:`treeattn.llm.cache`: the KV cache split along the sequence across ranks.
- :mod:`treeattn.llm.local_cache`, :mod:`treeattn.llm.generate`,
  :mod:`treeattn.llm.generate_context`: one process's cache and prefill, greedy decoding in
  one process, and the long repeated-document context.
- :mod:`treeattn.llm.prefill`: context-parallel prefill straight into the sharded cache
  (a pass-KV ring per layer, zig-zag balanced); :mod:`treeattn.llm.prefill_check` runs it
  on a group for the tests and the memory benchmark.
- :mod:`treeattn.llm.generate_dist`: the one bridge to :mod:`treeattn.runtime`; every layer's
  decode attention runs the plan's schedule on the launched ranks.
- :mod:`treeattn.llm.verify`: sharded attention checked against one process.

It sits above the runtime: ``treeattn.runtime`` never imports ``treeattn.llm``.
"""

from treeattn.llm.errors import ModelError

__all__ = ["ModelError"]
