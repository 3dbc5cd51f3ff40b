"""Building blocks that own weights (linear, embedding and LM head, norm) and the per-forward pieces
(rotary, attention over the KV cache, the forward description). Only these read or change weights."""
