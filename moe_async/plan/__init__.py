"""``moe-async plan``: before launch, check a config's parallel layout against its model and
cluster and estimate per-GPU memory of each role and the cost of one weight sync.

Modules, one job each: :mod:`.config` (the ``cluster`` section), :mod:`.arch` (parameter
counts from HF config fields), :mod:`.memory` (layout checks and the estimates),
:mod:`.table` (printing). Needs no weights and no GPU; torch is imported only to ask the trainer's model family
(moe_async.models) whether it takes the model.
"""
