"""Benchmark request sets: random tokens, ShareGPT conversations, shared prefixes.

Same names and sampling rules as vLLM's ``benchmark_dataset.py``:

* ``random``: input and output lengths uniform in ``[L (1 - r), L (1 + r)]``
  (``--random-input-len``, ``--random-output-len``, ``--random-range-ratio r``);
  prompts are random token ids (ids 1000..vocab-1000, away from special tokens).
* ``sharegpt``: a ShareGPT JSON file (a list of ``{"conversations": [{"from":
  "human"|"gpt", "value": str}, ...]}``); the first human turn is the prompt, the
  first reply's token count is the output length (unless ``output_len`` is given).
  Pairs with a prompt or reply under 4 tokens, a prompt over 1024 tokens or a
  total over 2048 are dropped (vLLM's filter).
* ``prefix-repetition``: ``num_prefixes`` random prefixes of ``prefix_len``
  tokens, each followed by a random ``suffix_len``-token suffix; prompts shuffled.

Every request carries both token ids and text (decoded with the tokenizer),
so the offline runner sends exact token ids and the HTTP client sends text.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

DATASETS = ("random", "sharegpt", "prefix-repetition")


@dataclass
class SampleRequest:
    """One benchmark request: ``prompt`` text, its ``prompt_token_ids`` (length
    ``prompt_len``) and the number of tokens to generate, ``expected_output_len``."""

    prompt: str
    prompt_token_ids: list[int]
    prompt_len: int
    expected_output_len: int


def _random_ids(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    lo, hi = (1000, vocab_size - 1000) if vocab_size > 4000 else (0, vocab_size - 1)
    return [rng.randint(lo, hi) for _ in range(n)]


def _length_range(length: int, ratio: float, what: str) -> tuple[int, int]:
    if length <= 0:
        raise ValueError(f"{what} must be positive, got {length}")
    if not 0 <= ratio < 1:
        raise ValueError(f"random range ratio must be in [0, 1), got {ratio}")
    return max(1, int(length * (1 - ratio))), int(length * (1 + ratio))


def _make(tokenizer, ids: list[int], output_len: int) -> SampleRequest:
    text = tokenizer.decode(ids) if tokenizer is not None else ""
    return SampleRequest(text, ids, len(ids), output_len)


def random_requests(num_prompts: int, input_len: int, output_len: int, *, range_ratio: float = 0.0,
                    seed: int = 0, tokenizer=None, vocab_size: int | None = None,
                    ) -> list[SampleRequest]:
    """``num_prompts`` prompts of random token ids with uniform lengths.

    Args:
        input_len, output_len: centre of each length range, tokens.
        range_ratio: lengths are uniform in ``[len * (1 - r), len * (1 + r)]``.
        tokenizer: decodes the ids to ``prompt`` text (optional).
        vocab_size: id range (default: the tokenizer's, else 32000).

    Raises:
        ValueError: a non-positive count or length, or a ratio outside [0, 1).
    """
    if num_prompts <= 0:
        raise ValueError(f"num_prompts must be positive, got {num_prompts}")
    in_lo, in_hi = _length_range(input_len, range_ratio, "input length")
    out_lo, out_hi = _length_range(output_len, range_ratio, "output length")
    vocab = vocab_size or (getattr(tokenizer, "vocab_size", None) if tokenizer else None) or 32000
    rng = random.Random(seed)
    out = []
    for _ in range(num_prompts):
        ids = _random_ids(rng, rng.randint(in_lo, in_hi), vocab)
        out.append(_make(tokenizer, ids, rng.randint(out_lo, out_hi)))
    return out


def prefix_repetition_requests(num_prompts: int, prefix_len: int, suffix_len: int,
                               num_prefixes: int, output_len: int, *, seed: int = 0,
                               tokenizer=None, vocab_size: int | None = None,
                               ) -> list[SampleRequest]:
    """Prompts sharing ``num_prefixes`` common prefixes (exercises prefix caching).

    Prompt ``i`` = prefix ``i % num_prefixes`` + its own random suffix; order shuffled.

    Raises:
        ValueError: non-positive lengths or counts.
    """
    for name, v in (("num_prompts", num_prompts), ("prefix_len", prefix_len),
                    ("num_prefixes", num_prefixes), ("output_len", output_len)):
        if v <= 0:
            raise ValueError(f"{name} must be positive, got {v}")
    if suffix_len < 0:
        raise ValueError(f"suffix_len must be >= 0, got {suffix_len}")
    vocab = vocab_size or (getattr(tokenizer, "vocab_size", None) if tokenizer else None) or 32000
    rng = random.Random(seed)
    prefixes = [_random_ids(rng, prefix_len, vocab) for _ in range(num_prefixes)]
    out = [_make(tokenizer, prefixes[i % num_prefixes] + _random_ids(rng, suffix_len, vocab),
                 output_len) for i in range(num_prompts)]
    rng.shuffle(out)
    return out


def sharegpt_requests(path: str, num_prompts: int, tokenizer, *, output_len: int | None = None,
                      seed: int = 0) -> list[SampleRequest]:
    """Sample ``num_prompts`` (prompt, reply length) pairs from a ShareGPT JSON file.

    Raises:
        ValueError: unreadable JSON, the wrong structure, or fewer usable
            conversations than ``num_prompts``.
    """
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read ShareGPT file {path!r}: {e}") from None
    if not isinstance(data, list):
        raise ValueError(f"{path!r}: expected a JSON list of {{'conversations': [...]}} entries")
    convs = [d["conversations"] for d in data
             if isinstance(d, dict) and isinstance(d.get("conversations"), list)
             and len(d["conversations"]) >= 2]
    random.Random(seed).shuffle(convs)
    out: list[SampleRequest] = []
    for conv in convs:
        if len(out) == num_prompts:
            break
        prompt, reply = conv[0].get("value", ""), conv[1].get("value", "")
        ids = tokenizer.encode(prompt)
        n_out = len(tokenizer.encode(reply)) if output_len is None else output_len
        if len(ids) < 4 or n_out < 4 or len(ids) > 1024 or len(ids) + n_out > 2048:
            continue
        out.append(SampleRequest(prompt, ids, len(ids), n_out))
    if len(out) < num_prompts:
        raise ValueError(f"{path!r}: only {len(out)} usable conversations for {num_prompts} "
                         "prompts (each needs a human turn and a reply of 4..1024 tokens)")
    return out


def add_dataset_args(parser, with_seed: bool = True) -> None:
    """The dataset flags shared by ``bench throughput`` and ``bench serve`` (vLLM's names).

    ``with_seed=False`` when the parser already has ``--seed`` (the engine flags).
    """
    g = parser.add_argument_group("dataset")
    g.add_argument("--dataset-name", default="random", choices=DATASETS)
    g.add_argument("--dataset-path", default=None, help="ShareGPT JSON file (sharegpt)")
    g.add_argument("--num-prompts", type=int, default=100)
    if with_seed:
        g.add_argument("--seed", type=int, default=0)
    g.add_argument("--random-input-len", type=int, default=256)
    g.add_argument("--random-output-len", type=int, default=128)
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len*(1-r), len*(1+r)]")
    g.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="override each ShareGPT reply length")
    g.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    g.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    g.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    g.add_argument("--prefix-repetition-output-len", type=int, default=128)


def load_requests(args, tokenizer) -> list[SampleRequest]:
    """Build the request list the dataset flags describe.

    Raises:
        ValueError: a missing ``--dataset-path`` for sharegpt, or bad lengths/counts.
    """
    if args.dataset_name == "sharegpt":
        if not args.dataset_path:
            raise ValueError("--dataset-name sharegpt needs --dataset-path FILE.json")
        return sharegpt_requests(args.dataset_path, args.num_prompts, tokenizer,
                                 output_len=args.sharegpt_output_len, seed=args.seed)
    if args.dataset_name == "prefix-repetition":
        return prefix_repetition_requests(
            args.num_prompts, args.prefix_repetition_prefix_len,
            args.prefix_repetition_suffix_len, args.prefix_repetition_num_prefixes,
            args.prefix_repetition_output_len, seed=args.seed, tokenizer=tokenizer)
    return random_requests(args.num_prompts, args.random_input_len, args.random_output_len,
                           range_ratio=args.random_range_ratio, seed=args.seed,
                           tokenizer=tokenizer)
