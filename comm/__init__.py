"""Tensor-parallel communication, run in the worker processes: the rank/group state and the all-reduce paths
(NCCL or gloo, and the symmetric-memory reducers on GPUs) that model layers call."""
