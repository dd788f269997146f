"""A keel model as an lm-evaluation-harness language model: `KeelLM` answers the harness's three
request types with keel's own forward pass (lm_scoring.Scorer), batched.

- loglikelihood(context, continuation): the continuation's summed log-probability given the
  context, and whether greedy decoding produces it. Text is tokenized as a whole and split where
  the context's tokens end (the harness's HF backend does the same), an empty context is the
  end-of-document id, trailing spaces of the context move to the continuation.
- loglikelihood_rolling(text): the text's log-probability in windows of the model's context,
  each token scored once (lm_scoring.rolling_requests).
- generate_until(context, gen_kwargs): up to max_gen_toks new tokens over the key/value cache,
  cut at the first `until` string; greedy unless do_sample with a temperature.

Importing this module imports lm-eval (and with it pandas and datasets): only `keel eval` does.
"""

from __future__ import annotations

from collections.abc import Sequence

from lm_eval.api.model import LM
from tokenizers import Tokenizer

from keel.train.lm_scoring import Scorer, ScoreRequest, rolling_requests

DEFAULT_MAX_GEN_TOKS = 256


class KeelLM(LM):
    """lm-eval's LM over a keel Scorer and the run's tokenizer."""

    def __init__(self, scorer: Scorer, tokenizer: Tokenizer) -> None:
        super().__init__()
        self.scorer = scorer
        self.tokenizer = tokenizer
        self.eos_id = scorer.trained.eos_id

    @property
    def tokenizer_name(self) -> str:
        return self.scorer.trained.tokenizer_path

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """(context ids, continuation ids) as the harness's HF backend splits them."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        if not context:
            return [self.eos_id], self.encode(continuation)
        whole = self.encode(context + continuation)
        context_ids = self.encode(context)
        return whole[: len(context_ids)], whole[len(context_ids) :]

    def loglikelihood(self, requests: Sequence) -> list[tuple[float, bool]]:
        pairs = [self.encode_pair(*request.args) for request in requests]
        scorable = [i for i, (_, continuation) in enumerate(pairs) if continuation]
        scored = self.scorer.score(
            [ScoreRequest(tuple(pairs[i][0] + pairs[i][1]), len(pairs[i][1])) for i in scorable]
        )
        out = [(0.0, True)] * len(pairs)  # an empty continuation: probability 1
        for i, result in zip(scorable, scored, strict=True):
            out[i] = (result.logprob, result.greedy)
            self.cache_hook.add_partial("loglikelihood", requests[i].args, out[i])
        return out

    def loglikelihood_rolling(self, requests: Sequence) -> list[float]:
        windows: list[ScoreRequest] = []
        owners: list[int] = []
        for index, request in enumerate(requests):
            (text,) = request.args
            for window in rolling_requests(self.encode(text), self.eos_id, self.scorer.max_length):
                windows.append(window)
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, result in zip(owners, self.scorer.score(windows), strict=True):
            totals[owner] += result.logprob
        return totals

    def generate_until(self, requests: Sequence) -> list[str]:
        return [self._generate(*request.args) for request in requests]

    def _generate(self, context: str, gen_kwargs: dict) -> str:
        until = gen_kwargs.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        max_new = int(gen_kwargs.get("max_gen_toks", DEFAULT_MAX_GEN_TOKS))
        temperature = float(gen_kwargs.get("temperature", 0.0) or 0.0)
        if not gen_kwargs.get("do_sample", False):
            temperature = 0.0

        def stop(new_ids: list[int]) -> bool:
            text = self.tokenizer.decode(new_ids)
            return any(marker in text for marker in until)

        prompt = self.encode(context) or [self.eos_id]
        new_ids = self.scorer.continue_ids(prompt, max_new, stop, temperature)
        text = self.tokenizer.decode(new_ids)
        for marker in until:
            text = text.split(marker)[0]
        self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
        return text
