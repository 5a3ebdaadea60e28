"""Multi-LoRA serving (``--lora-modules NAME=PATH``, ``--enable-lora``, ``--max-loras``,
``--max-lora-rank``).

- ``peft_adapter``: reads a PEFT adapter directory into per-layer (A, B) pairs, the scaling
  (``lora_alpha / r``, or ``/ sqrt(r)`` under rsLoRA) folded into B.
- ``slots``: the stacked per-layer tensors the model's projections read, slot 0 the base model
  (zeros), and ``AdapterCache``: which adapter sits in which slot, loaded lazily, least recently
  used out beyond ``--max-loras``, never one that a running sequence uses. Adapters are added
  and removed at run time (``POST /v1/load_lora_adapter``, engine commands ``load_lora`` /
  ``unload_lora``); a removal waits for the requests under the adapter to end.

Every token of a step carries its sequence's slot (``AttentionMetadata.lora_slots``), so
sequences of several adapters and of none share one batch (``ops.lora_delta``).
"""
