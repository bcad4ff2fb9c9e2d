"""The KV host tier (`host_kv_tier_bytes`): running sequences whose KV lives in host memory.

Everything the tier is sits here, behind what the runner asks of `tier.HostKVTier`: how a step
is laid out in micro-batches by tier (`groups`), the step's attention metadata naming each
micro-batch's caches (`attention`), the end of a step (`end_step`), where a sequence's blocks are
for hold and export (`holding`), and its counters. The block pool only counts the tier's blocks
(ids from the device cache's size up); the model and its layers see one `AttentionMetadata`.
    batch.py    a micro-batch in block ids and its attention metadata
    cost.py     swap into device staging or attend on the host: the rates and the choice
    caches.py   the host caches and the caches each host micro-batch attends in
    staging.py  two device staging caches, the next swapped micro-batch copied while one attends
    tier.py     `HostKVTier`: the runner's interface
docs/offload.md, "Module-based batching with KV in host memory".
"""
