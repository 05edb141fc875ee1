"""Downstream benchmarks: lm-evaluation-harness tasks scored through any function of token ids
to logits (`harness`: lm-eval's model class; `scoring`: the token-level work, in plain torch)."""
