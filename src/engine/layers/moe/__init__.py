"""Mixture-of-experts: the router's top-k (router.py), the experts' forward grouped by expert
(fused_moe_native.py on the CPU, fused_moe_triton/ on the GPU) and the layer that holds the
stacked expert weights and shards them across TP / EP ranks (layer.py)."""
