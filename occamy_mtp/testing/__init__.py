"""Builders of tiny real-layout checkpoints, tokenizers and data for tests, benchmarks and the demo."""
