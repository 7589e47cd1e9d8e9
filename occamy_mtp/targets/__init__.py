"""The frozen base's targets: its forward over windows (plain and packed) and the offline cache's format."""
