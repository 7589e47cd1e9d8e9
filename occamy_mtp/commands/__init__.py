"""The commands: one module each, named after the command (`python -m occamy_mtp <command>`;
`serve_reference` is `serve-reference`, `demo_models` `demo-models`). A command parses its
flags (`occamy_mtp.cli`), calls the library and prints; nothing in the library imports it."""
