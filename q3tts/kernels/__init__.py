"""The kernels of the GPU path (Triton and Gluon), one file per family, each with a plain-PyTorch twin of the
same semantics.

The twins run on the CPU (the eager path) and are what the tests compare every kernel against. All kernels
work on a flat list of tokens; token t belongs to cache row `rows[t]` and sits at position `positions[t]`, so
one kernel serves prefill (many tokens per row), the talker step (one per row) and the code predictor.

KV caches are paged: k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]; row r's position p
lives in block `block_table[r, p // block_size]`, slot `p % block_size`.

Numerics: norms, RoPE, softmax and sampling in fp32; the residual stream is fp32; matrix products in the
weights' dtype (bf16 on the GPU) with fp32 accumulation.
"""

