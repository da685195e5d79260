"""The compressed KV cache, engine-independent: per-layer slot storage (:mod:`.layer_store`, 8-bit entries in
:mod:`.quant`), prefill compression and budgets (:mod:`.prefill`), chunked prefill (:mod:`.chunked`), the single-token
decode step shared by the transformers engine and the vLLM pool (:mod:`.decode_step`, fused on CUDA by
:mod:`.fused_step`), multi-token decoding (:mod:`.decoding`) and byte accounting (:mod:`.accounting`);
:class:`.compressed.CompressedKV` ties them together (``docs/conventions.md``)."""
