"""Served acceptance (decoder replay), agreement, NLL; the reference speculative decoder; the plot."""
