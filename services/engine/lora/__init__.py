"""Multi-LoRA serving (``--lora-modules NAME=PATH``, ``--max-loras``, ``--max-lora-rank``).

- ``peft_adapter``: reads a PEFT adapter directory into per-layer (A, B) pairs, the scaling
  (``lora_alpha / r``, or ``/ sqrt(r)`` under rsLoRA) folded into B.
- ``slots``: the stacked per-layer tensors the model's projections read, slot 0 the base model
  (zeros), and ``AdapterCache``: which adapter sits in which slot, loaded lazily, least recently
  used out beyond ``--max-loras``, never one that a running sequence uses.

Every token of a step carries its sequence's slot (``AttentionMetadata.lora_slots``), so
sequences of several adapters and of none share one batch (``ops.lora_delta``).
"""
