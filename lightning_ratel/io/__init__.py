"""Whole-model state, streamed block by block through the swap store: pretrained weights in, sharded checkpoints,
the Hugging Face export, and the converter between checkpoint formats."""
