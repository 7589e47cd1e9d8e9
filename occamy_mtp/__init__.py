"""occamy-mtp: adapt a Qwen3.5-MoE MTP draft head to a fine-tuned base.

Subpackages in data-flow order (imports point downstream only): model (the head, checkpoint
I/O, the loss) -> data (windows) -> targets (the frozen base) -> selfgen (the base's own
text) -> run (one set-up path) -> evaluation -> train -> export -> serve, on the
foundation of config, cli, files and errors. docs/developer/LAYOUT.md has each module.
"""

import os

__version__ = "0.1.0"

# Expandable segments for torch's CUDA allocator (unless the user chose its settings): the
# base fills most of an 80 GB card, and the batches beside it are sized to what is free
# (`occamy_mtp.memory`). With expandable segments the allocator's cached blocks count as free,
# so the logits chunks of every training step are sized without handing the cache back, and
# the batches come out larger and the recipe runs faster than on fixed segments (bench/results/recipe.md,
# and the notebook's sections it lists). Read when CUDA first allocates, so set on import. Torch
# reads PYTORCH_CUDA_ALLOC_CONF before PYTORCH_ALLOC_CONF: setting the first would override
# a user's choice in the second.
if not (os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF")):
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
