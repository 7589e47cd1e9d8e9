"""The base's own text: the store of its continuations and who writes them (the base through
`occamy_mtp.base`'s decoders, or serving engines), and the `generate` command."""
