"""The MTP head as the engine runs it, checkpoint I/O, and what the head trains on (batching, chain alignment, the loss)."""
