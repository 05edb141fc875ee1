"""Using a trained checkpoint: sampling text (`generate`), the loss, perplexity and
bits-per-byte of a whole split on Ray actors (`evaluate`), and lm-eval tasks on Ray actors
(`tasks`)."""
