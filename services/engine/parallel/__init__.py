"""Tensor parallelism: one worker's model sharded over ``--tensor-parallel-size`` ranks.

Rank 0 is the worker process: it speaks NATS, schedules, samples, and owns every piece of engine
state (``LLMEngine``). Ranks 1..N-1 are processes it starts (``rank.py``) that hold only their
shard of the weights and of the KV cache. Each step, rank 0 sends every rank the step's inputs
once (``StepInputs``: plain host lists), and every rank runs the same forward pass on its shard;
the row-parallel layers' all-reduces (``shard.py``) are the only traffic inside the step.

Sharding is vLLM's: q/k/v and gate/up are column-parallel, o and down row-parallel with an
all-reduce, attention and KV heads split over the ranks (a KV head replicated where TP exceeds
their number, ``shared/kv/tp_layout.py``). The embedding and the LM head stay whole: a lookup
needs no all-reduce that way, and only rank 0 runs the head, since only rank 0 samples.

A rank that dies takes the worker down (``group.py``): rank 0 announces it is gone, so the
gateway migrates its streams as for any worker that dies.
"""
