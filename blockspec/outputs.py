"""What `LLM` hands back: a finished request (`RequestOutput`), and a streamed request's pieces
(`StreamDelta`) as its tokens are committed."""

from __future__ import annotations

from dataclasses import dataclass, field

from blockspec.engine.sampler import TokenLogprob
from blockspec.engine.sequence import Sequence
from blockspec.engine.stats import RequestStats
from blockspec.engine.text_stream import Piece


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    speculative_algorithm: str
    block_size: int
    time_to_first_token_s: float
    decode_time_s: float
    stats: RequestStats
    # Per output token: (where it came from: "draft" or "lookup", a candidate the target verified, or
    # "target", its own token; the decode step that committed it)
    token_sources: list[tuple[str, int]] = field(default_factory=list)
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache (not prefilled)
    # With SamplingParams(logprobs=k): per output token, its log-probability and the k best under the target.
    logprobs: list[TokenLogprob] | None = None

    @property
    def accept_lengths(self) -> list[int]:
        return self.stats.accept_lengths

    @property
    def mean_accept_length(self) -> float | None:
        """tau, None where no DFlash step was taken."""
        return self.stats.mean_accept_length

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first over the time after the first (prefill excluded)."""
        n = len(self.token_ids) - 1
        return n / self.decode_time_s if n > 0 and self.decode_time_s > 0 else 0.0


@dataclass
class StreamDelta:
    """The tokens one engine step committed for a streamed request and the text they add (text that may
    begin a stop string is held back until it is known not to), that text token by token with each token's
    source in `pieces`; the last delta carries the whole `output`."""

    text: str
    token_ids: list[int]
    token_sources: list[tuple[str, int]]
    pieces: list[Piece] = field(default_factory=list)
    output: RequestOutput | None = None


def request_output(seq: Sequence, speculative: bool, block_size: int, text: str) -> RequestOutput:
    """A finished (or stopped) request's output; `text`: its output as text."""
    first = seq.first_token_time  # None: stopped before its first token
    return RequestOutput(
        prompt_token_ids=seq.prompt_ids,
        text=text,
        token_ids=list(seq.output_ids),
        finish_reason=seq.finish_reason,
        speculative_algorithm="DFLASH" if speculative else "NONE",
        block_size=block_size,
        time_to_first_token_s=(first - seq.arrival_time) if first is not None else 0.0,
        decode_time_s=(seq.finish_time - first) if first is not None else 0.0,
        stats=seq.stats,
        token_sources=list(seq.token_sources),
        cached_tokens=min(seq.cached_tokens, len(seq.prompt_ids)),
        logprobs=list(seq.logprobs) if seq.params.logprobs is not None else None,
    )
