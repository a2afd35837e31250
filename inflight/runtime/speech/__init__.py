"""Text to speech under in-flight batching: a speech request is a resident whose every step
is one frame (the talker's step batched across rows, then the code predictor's micro-loop
batched across them), its audio decoded as its frames arrive."""
