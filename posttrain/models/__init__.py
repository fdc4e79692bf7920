"""Model loading, the tiny-model factory, and chunked log-probabilities."""
