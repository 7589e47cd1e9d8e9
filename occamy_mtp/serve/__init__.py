"""Serving: endpoint validation against SGLang and vLLM, and a small OpenAI-compatible reference server."""
