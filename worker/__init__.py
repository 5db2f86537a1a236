"""The worker process, one per device (``python -m worker``): its weight shard, KV pool, CUDA graphs and sampler.
It runs the steps the coordinator sends; it never imports coordinator/."""
