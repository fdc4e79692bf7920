"""The math of post-training: pure functions over tensors, grouped in registries.

Nothing here touches models, data loaders or ranks. A trainer computes per-sequence or per-token
log-probs, then calls a function from here; each function carries its formula and paper in its
docstring. Modules: ``registry`` (name → function tables), ``sft`` (token-normalised NLL),
``preference`` (DPO-family losses and metrics), ``reward`` (Bradley–Terry reward-model loss).
"""
