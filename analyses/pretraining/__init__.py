"""How the embedded models were trained: the mini pair (``pretrain``, ``ship``), the resumable 12-layer
recipe (``pretrain_base``, ``recipe``), the reproducibility check and the committed sample."""
