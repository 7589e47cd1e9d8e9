"""occamy-mtp: adapt a Qwen3.5-MoE MTP draft head to a fine-tuned base.

Subpackages in data-flow order (imports point downstream only): model (the head, checkpoint
I/O, the loss) -> data (windows) -> targets (the frozen base) -> selfgen (the base's own
text) -> run (one set-up path) -> evaluation -> train -> export -> serve, on the
foundation of config, cli, files and errors. README.md's layout table has each module.
"""

__version__ = "0.1.0"
