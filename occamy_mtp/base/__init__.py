"""The frozen base's own compute: its fast forward passes, decoders and the kernels under them.

`fastbase` (the cache pass's batched prefill), `fastdecode` (batched decoding with CUDA
graphs), `generate` (transformers' decoding, the reference; where a continuation ends),
`logits` (greedy choices a chunk at a time), the Triton kernels `moe_kernels` and
`decode_kernels`, and `tuning` (fla's fixed kernel configs). Imported by selfgen, targets,
evaluation and serve; imports nothing of theirs.
"""
