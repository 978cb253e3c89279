"""Inputs: corpus readers, windows and shards, masking policies, and the masked-batch pipeline."""
