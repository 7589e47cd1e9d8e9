"""The exported head, metrics and TRAINING.json; the servable directory; what a checkpoint holds."""
