"""What lm-evaluation-harness asks of a model, in plain torch: the log-probability of a
continuation after a context (batched, left-truncated to the model's context) and greedy
continuations with stop strings. `raylm.downstream.harness` turns lm-eval's requests into these.

A `Scorer` computes with any function from token ids to logits: a checkpoint's plain model on a
Ray actor (`raylm.inference.tasks`, for `raylm eval --tasks`) or a training run's sharded model,
where every rank calls it with the same ids (`train.eval_tasks`). No lm_eval import here: actors
run this without the package.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from raylm.data.tokenizer import Tokenizer
from raylm.model.sampling import generate

LogitsFn = Callable[[torch.Tensor], torch.Tensor]
"""(B, T) int64 ids on the CPU -> (B, T, V) logits on the model's device."""

Pair = tuple[list[int], list[int]]
"""(context ids, continuation ids): the continuation is scored after the context."""

Prompt = tuple[list[int], int, list[str]]
"""(context ids, most tokens to generate, stop strings)."""


class Scorer:
    def __init__(self, logits: LogitsFn, tokenizer: Tokenizer, max_len: int, batch_size: int):
        self.logits, self.tokenizer, self.max_len, self.batch_size = logits, tokenizer, max_len, batch_size

    @torch.no_grad()
    def loglikelihoods(self, pairs: list[Pair]) -> list[tuple[float, bool]]:
        """For each pair, the summed log-probability of its continuation and whether greedy
        decoding would have produced exactly it (lm-eval's `loglikelihood` result)."""
        for context, continuation in pairs:
            if not continuation or len(continuation) > self.max_len or not context:
                raise ValueError(f"cannot score a continuation of {len(continuation)} token(s) after "
                                 f"{len(context)}: a continuation takes 1 to {self.max_len} (the model's "
                                 "context) tokens after at least one")
        # Longest first, as lm-eval's own models order them: each batch pads little.
        order = sorted(range(len(pairs)), key=lambda i: -(len(pairs[i][0]) + len(pairs[i][1])))
        results: list[Optional[tuple[float, bool]]] = [None] * len(pairs)
        for start in range(0, len(order), self.batch_size):
            batch = order[start:start + self.batch_size]
            # As lm-eval's HF model: the last max_len + 1 tokens, the last of them a target only.
            inputs = [(pairs[i][0] + pairs[i][1])[-(self.max_len + 1):-1] for i in batch]
            # Right padding: causal attention keeps it out of every position before it.
            ids = torch.zeros(len(batch), max(map(len, inputs)), dtype=torch.long)
            for row, seq in enumerate(inputs):
                ids[row, :len(seq)] = torch.tensor(seq)
            logprobs = F.log_softmax(self.logits(ids).float(), dim=-1)
            for row, i in enumerate(batch):
                continuation, end = pairs[i][1], len(inputs[row])
                targets = torch.tensor(continuation, device=logprobs.device)
                scores = logprobs[row, end - len(continuation):end]  # positions that predict the continuation
                total = scores.gather(-1, targets[:, None]).sum(dtype=torch.float64)
                results[i] = (float(total), bool((scores.argmax(-1) == targets).all()))
        return results  # type: ignore[return-value]

    def greedy(self, prompts: list[Prompt]) -> list[str]:
        """Greedy continuations, each up to its first stop string (excluded) or end of text."""
        tok = self.tokenizer

        def stops(until: list[str]) -> Callable[[list[int]], bool]:
            return lambda new: new[-1] == tok.eot_id or any(s and s in tok.decode(new) for s in until)

        texts = []
        for context, max_new, until in prompts:
            if max_new >= self.max_len:
                raise ValueError(f"cannot generate {max_new} tokens with a context of {self.max_len}: "
                                 "lower the task's max_gen_toks")
            new = generate(self.logits, context[-(self.max_len - max_new):], max_new, temperature=0,
                           vocab_size=tok.vocab_size, max_len=self.max_len, stop=stops(until))
            text = tok.decode([i for i in new if i != tok.eot_id])
            for s in until:
                text = text.split(s)[0] if s else text
            texts.append(text)
        return texts
