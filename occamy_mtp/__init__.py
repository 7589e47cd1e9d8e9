"""occamy-mtp: adapt a Qwen3.5-MoE MTP draft head to a fine-tuned base.

Stages, in data-flow order (imports point downstream only):
data -> target (frozen base) -> head -> loss -> train -> evaluate -> export,
with config and checkpoint I/O beside them.
"""

__version__ = "0.1.0"
