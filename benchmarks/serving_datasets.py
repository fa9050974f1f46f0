"""Workloads for bench_serving: `random`, `generated-shared-prefix` and a synthetic ShareGPT-like set.

Everything here is deterministic in the seed and needs no network. `random` and
`generated-shared-prefix` draw token ids with `random.Random(seed)` in exactly the order that
bench_offline_throughput.py uses, so the HTTP benchmark and the in-process benchmark see the same
prompts and output lengths and their throughputs can be divided.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, Iterator, List, Optional, Sequence

# Ids below 10 and in the last 10 of the vocabulary are left out: that is where tokenizers keep
# their special tokens (BOS/EOS/pad), which would end or distort a prompt.
TOKEN_ID_MARGIN = 10

# SGLang's ShareGPT filter: drop tiny turns and keep prompts and whole exchanges within a context.
SHAREGPT_MIN_LEN = 4
SHAREGPT_MAX_PROMPT_LEN = 1024
SHAREGPT_MAX_TOTAL_LEN = 2048


@dataclass
class SampledRequest:
    """One benchmark request: the prompt as token ids and/or text, and how many tokens to generate."""

    prompt_len: int
    output_len: int
    prompt_ids: Optional[List[int]] = None
    prompt_text: Optional[str] = None


def length_range(length: int, range_ratio: float) -> tuple[int, int]:
    """SGLang's random-length rule: lengths drawn from [max(int(length * ratio), 1), length]."""
    if length < 1:
        raise ValueError(f"length must be >= 1, got {length}")
    if not 0.0 <= range_ratio <= 1.0:
        raise ValueError(f"range ratio must be in [0, 1], got {range_ratio}")
    return max(int(length * range_ratio), 1), length


def _random_ids(rng: random.Random, count: int, vocab_size: int) -> List[int]:
    return [rng.randrange(TOKEN_ID_MARGIN, vocab_size - TOKEN_ID_MARGIN) for _ in range(count)]


def _check_vocab(vocab_size: int) -> None:
    if vocab_size <= 2 * TOKEN_ID_MARGIN:
        raise ValueError(f"vocab size must be > {2 * TOKEN_ID_MARGIN}, got {vocab_size}")


def sample_random_requests(num_prompts: int, input_len: int, output_len: int, range_ratio: float,
                           vocab_size: int, seed: int) -> List[SampledRequest]:
    """Random token-id prompts; lengths uniform in SGLang's [len * ratio, len] ranges.

    Same draws, in the same order, as bench_offline_throughput.random_workload with
    in_range = length_range(input_len, ratio) and out_range = length_range(output_len, ratio).
    """
    _check_vocab(vocab_size)
    in_lo, in_hi = length_range(input_len, range_ratio)
    out_lo, out_hi = length_range(output_len, range_ratio)
    rng = random.Random(seed)
    prompts = [_random_ids(rng, rng.randint(in_lo, in_hi), vocab_size) for _ in range(num_prompts)]
    output_lens = [rng.randint(out_lo, out_hi) for _ in range(num_prompts)]
    return [SampledRequest(prompt_len=len(p), output_len=o, prompt_ids=p) for p, o in zip(prompts, output_lens)]


def sample_generated_shared_prefix_requests(num_groups: int, prompts_per_group: int, system_prompt_len: int,
                                            question_len: int, output_len: int, vocab_size: int,
                                            seed: int) -> List[SampledRequest]:
    """Groups of prompts that share a system prompt (what the radix cache is for).

    Requests stay grouped in order (group 0's prompts first), as in bench_offline_throughput's
    shared-prefix workload, so both benchmarks draw the same ids.
    """
    _check_vocab(vocab_size)
    rng = random.Random(seed)
    requests = []
    for _ in range(num_groups):
        system = _random_ids(rng, system_prompt_len, vocab_size)
        for _ in range(prompts_per_group):
            prompt = system + _random_ids(rng, question_len, vocab_size)
            requests.append(SampledRequest(prompt_len=len(prompt), output_len=output_len, prompt_ids=prompt))
    return requests


# A small English vocabulary: real words, so BPE tokenizers split the prompts like real text
# (about 1.3 tokens a word for common English), not like random ids.
_WORDS = """
the of and to a in is it you that he was for on are with as I his they be at one have this from
or had by not word but what some we can out other were all there when up use your how said an
each she which do their time if will way about many then them write would like so these her long
make thing see him two has look more day could go come did number sound no most people my over
know water than call first who may down side been now find any new work part take get place made
live where after back little only round man year came show every good me give our under name very
through just form sentence great think say help low line differ turn cause much mean before move
right boy old too same tell does set three want air well also play small end put home read hand
port large spell add even land here must big high such follow act why ask men change went light
kind off need house picture try us again animal point mother world near build self earth father
head stand own page should country found answer school grow study still learn plant cover food sun
four between state keep eye never last let thought city tree cross farm hard start might story saw
far sea draw left late run while press close night real life few north open seem together next white
children begin got walk example ease paper group always music those both mark often letter until
mile river car feet care second book carry took science eat room friend began idea fish mountain
stop once base hear horse cut sure watch color face wood main enough plain girl usual young ready
above ever red list though feel talk bird soon body dog family direct pose leave song measure door
product black short numeral class wind question happen complete ship area half rock order fire south
problem piece told knew pass since top whole king space heard best hour better during hundred five
remember step early hold west ground interest reach fast verb sing listen six table travel less
morning ten simple several vowel toward war lay against pattern slow center love person money serve
appear road map rain rule govern pull cold notice voice unit power town fine certain fly fall lead
cry dark machine note wait plan figure star box noun field rest correct able pound done beauty drive
stood contain front teach week final gave green quick develop ocean warm free minute strong special
mind behind clear tail produce fact street inch multiply nothing course stay wheel full force blue
object decide surface deep moon island foot system busy test record boat common gold possible plane
""".split()

_QUESTION_STARTS = ["How do I", "Can you explain why", "What is the best way to", "Please write about how to",
                    "Why does", "Tell me how to", "Could you help me", "Summarize how"]


def _zipf_cumulative_weights(n: int) -> List[float]:
    # Word frequencies in text follow Zipf's law; with it the text has the repetition of real text.
    total, cumulative = 0.0, []
    for rank in range(1, n + 1):
        total += 1.0 / rank
        cumulative.append(total)
    return cumulative


_WORD_WEIGHTS = _zipf_cumulative_weights(len(_WORDS))


def _sentence(rng: random.Random, num_words: int, end: str) -> str:
    words = rng.choices(_WORDS, cum_weights=_WORD_WEIGHTS, k=num_words)
    return " ".join(words).capitalize() + end


def _conversation_text(rng: random.Random, num_words: int) -> str:
    """A user turn of about num_words words: some context sentences, then a question."""
    question_words = min(num_words, rng.randint(4, 12))
    parts, remaining = [], num_words - question_words
    while remaining > 0:
        n = min(remaining, rng.randint(5, 20))
        parts.append(_sentence(rng, n, "."))
        remaining -= n
    start = rng.choice(_QUESTION_STARTS)
    parts.append(f"{start} {_sentence(rng, question_words, '?').lower()}")
    return " ".join(parts)


def _lognormal_int(rng: random.Random, median: float, sigma: float, low: int, high: int) -> int:
    # A log-normal has the long right tail that ShareGPT's prompt and answer lengths show.
    return int(min(high, max(low, round(rng.lognormvariate(math.log(median), sigma)))))


def sample_synthetic_sharegpt_requests(num_prompts: int, seed: int, tokenizer: Any = None,
                                       prompt_median_words: float = 120.0, prompt_sigma: float = 1.0,
                                       output_median_tokens: float = 160.0, output_sigma: float = 0.8,
                                       fixed_output_len: Optional[int] = None,
                                       max_prompt_len: int = SHAREGPT_MAX_PROMPT_LEN,
                                       max_total_len: int = SHAREGPT_MAX_TOTAL_LEN) -> List[SampledRequest]:
    """ShareGPT-like text prompts: log-normal prompt and output lengths, SGLang's length filter.

    With a tokenizer (anything with `encode(text) -> ids`) prompt lengths are exact token counts
    and the prompt ids are kept; without one they are estimated from the word count.
    """
    rng = random.Random(seed)
    requests: List[SampledRequest] = []
    attempts = 0
    while len(requests) < num_prompts:
        attempts += 1
        if attempts > 100 * num_prompts + 1000:
            raise ValueError("cannot draw enough ShareGPT-like prompts within the length limits")
        num_words = _lognormal_int(rng, prompt_median_words, prompt_sigma, 1, 4 * max_prompt_len)
        text = _conversation_text(rng, num_words)
        output_len = fixed_output_len or _lognormal_int(rng, output_median_tokens, output_sigma, 1, max_total_len)
        ids = list(tokenizer.encode(text)) if tokenizer is not None else None
        prompt_len = len(ids) if ids is not None else estimate_tokens(text)
        if prompt_len < SHAREGPT_MIN_LEN or output_len < SHAREGPT_MIN_LEN:
            continue
        if prompt_len > max_prompt_len or prompt_len + output_len > max_total_len:
            continue
        requests.append(SampledRequest(prompt_len=prompt_len, output_len=output_len, prompt_text=text))
    return requests


def estimate_tokens(text: str) -> int:
    """Token count of English text without a tokenizer: about 1.3 BPE tokens a word."""
    return max(1, round(1.3 * len(text.split())))


def poisson_intervals(num_requests: int, request_rate: float, seed: int) -> Iterator[float]:
    """Gaps between arrivals: exponential with mean 1/rate (a Poisson process); 0 when rate is inf."""
    rng = random.Random(seed)
    for _ in range(num_requests):
        yield 0.0 if math.isinf(request_rate) else rng.expovariate(request_rate)


def total_prompt_tokens(requests: Sequence[SampledRequest]) -> int:
    return sum(r.prompt_len for r in requests)
