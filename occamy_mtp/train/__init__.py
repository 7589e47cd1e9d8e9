"""Training the head: one loop, top to bottom, with checkpoint selection."""
