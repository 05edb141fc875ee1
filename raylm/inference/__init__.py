"""Using a trained checkpoint: sampling text (`generate`), and the loss, perplexity and
bits-per-byte of a whole split on Ray actors (`evaluate`)."""
