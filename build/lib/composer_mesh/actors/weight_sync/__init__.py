"""Topology-aware weight sync, one module per job; the layout and design are in docs/weight_sync.md."""
