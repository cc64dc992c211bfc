"""The CPU kernel chain: small fp32 calls through numpy (:mod:`.cpu_small`), treeattn's C
kernel (:mod:`.cpu_native`, sources in ``native/``), torch's fused FlashAttention kernel for
other dense KV (:mod:`.cpu_fused`)."""
