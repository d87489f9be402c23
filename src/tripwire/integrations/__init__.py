"""Integrations: tripwire installed into engines nobody here wrote, from outside, in one call, and undone.

* :mod:`tripwire.integrations.transformers`: Hugging Face transformers' continuous batching
  (``model.generate_batch``, ``init_continuous_batching``, ``transformers serve``).

Each integration is imported explicitly (``from tripwire.integrations import transformers as tw_transformers``):
importing tripwire never imports an engine.
"""

__all__: list[str] = []
