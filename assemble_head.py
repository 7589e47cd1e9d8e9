"""Assemble a servable directory from the base and the trained head:
`python assemble_head.py --base BASE_DIR --head out/mtp-trained.safetensors --out SERVE_DIR`."""

from occamy_mtp.commands.assemble import main

if __name__ == "__main__":
    raise SystemExit(main(prog="assemble_head.py"))
