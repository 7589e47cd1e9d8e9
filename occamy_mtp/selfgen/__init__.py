"""The base's own text: greedy decoding (batched, or the static batch decoder on CUDA), serving engines, the store."""
