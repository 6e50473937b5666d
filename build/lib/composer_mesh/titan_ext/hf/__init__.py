"""Hugging Face checkpoints and TorchTitan models.

config: config.json files (read, checked, written for serving); derive:
config.json <-> TorchTitan model configs; adapters: weight names
(TorchTitan's state-dict adapters) and HF-named buckets; read: safetensors
directories into a model; write: a model out to an HF directory; parity: the
load-time logits check against transformers; export: a run's checkpoint as
an HF directory.
"""
