"""Attention math below the cache: the safe softmax (:mod:`.softmax`), the PTAA linear state of evicted tokens
(:mod:`.linear_state`) and the attention over kept slots plus its first-order Taylor term (:mod:`.ptaa`; SLAKE
paper, Sections 3.2-3.3). Plain tensor math shared by both engines and the fused kernels' torch reference."""
