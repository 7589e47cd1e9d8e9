"""Talking to serving engines (SGLang, vLLM, the library's reference server) over their
OpenAI-compatible APIs: `http` the transport, `openai` the shared protocol, `completions` a
completion of token ids, one reader per engine (`sglang`, `vllm`) and the checked fields
they read (`fields`). Self-generation (`selfgen.engine_writer`) and validation (`serve`) use it.
"""
