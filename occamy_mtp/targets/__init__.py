"""The frozen base's targets: online (its forward through `occamy_mtp.base`) and the offline cache's format."""
