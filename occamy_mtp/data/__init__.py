"""Chat files into assistant-only windows and their split (`python -m occamy_mtp data` reports what a file gives)."""
