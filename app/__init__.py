"""The HTTP service around the encoder in `model/`."""
