"""fastdistill's Triton kernels (fused lm_head + sparse candidates + tail + generalized JSD).

Self-contained: imports only torch and triton. The kernels land with the kernels issue; until then
`fastdistill.sparse_jsd_loss` runs its memory-bounded torch path everywhere.
"""
