"""Attention kernels: attention with log-sum-exp on local chunks, and the merge of partial results.

The algorithms call attend.py (`attend_chunks`, `attend_masked`, `attention_with_lse`) with each query block's
running state (partial.py); choice.py picks the kernel of each call (rules, then dispatch.py's measured choice
that every rank of a layer shares); the kernels: reference.py, sdpa.py, fused.py (Gluon or Triton), merge.py;
what they keep between calls: state.py. rotary.py is Flux's RoPE of Q and K in one pass.
"""
