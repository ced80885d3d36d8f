"""Grammar compilation and token masks with xgrammar (Dong et al., "XGrammar: Flexible
and Efficient Structured Generation Engine for Large Language Models", 2024;
https://github.com/mlc-ai/xgrammar), as vLLM's ``xgrammar`` structured-output backend.

Why xgrammar and not llguidance (both measured here, ``benchmarks/grammar_libs.py``,
SmolLM2's 49152-token vocab, a 6-property JSON schema with nested object, enum and
patterns, 59 output tokens; 2026-12-03, quiet 2-core AMD EPYC, xgrammar 0.2.9,
llguidance 1.9.1)::

    library      setup ms  schema compile ms  mask fill/token us p50 (p90)  advance us
    xgrammar        229          17.9                  3.1  (15.8)              1.6
    llguidance      382           1.2                 12.9  (94.0)              1.2

The mask is filled for every constrained row at every step, on the step's critical
path; the compile runs once per schema, off it (cached, in a worker thread on the
server). xgrammar's precompiled adaptive token-mask cache makes the per-token fill ~4x
cheaper at the median and ~6x at p90, which is what the batch pays; llguidance's lazy
compile is 15x faster, but its compile is not on the critical path here. Both masks are
applied by our own torch code (:func:`llmserve.layers.sampler.apply_token_bitmask`,
~95 us per row at this vocab, the same for either). xgrammar also offers jump-forward
(:meth:`GrammarMatcher.jump_forward`).

Bitmask layout (xgrammar's and llguidance's): ``[B, ceil(V / 32)]`` int32, bit ``t % 32``
of word ``t // 32`` set when token ``t`` is allowed. Rows without a grammar stay all
ones (-1).

JSON whitespace: schemas compile with ``any_whitespace=False`` (separators ``", "`` and
``": "``), so a small model cannot loop on whitespace inside a JSON value (a known
failure of any-whitespace JSON grammars) and the output is compact.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import Any

import torch

from llmserve.sampling_params import StructuredOutputsParams

CACHE_SIZE = 256  # compiled grammars kept (LRU), keyed by (kind, canonical spec)


def allocate_bitmask(batch: int, vocab_size: int) -> torch.Tensor:
    """``[batch, ceil(V / 32)]`` int32, all tokens allowed (-1)."""
    return torch.full((batch, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def lark_to_ebnf(source: str) -> str:
    """Translate a simple Lark grammar to xgrammar's EBNF (as vLLM's
    ``convert_lark_to_ebnf``): ``rule: a | b`` -> ``rule ::= a | b``, continuation lines
    starting with ``|``, ``start`` -> ``root``, ``?rule`` / ``rule.N`` markers dropped,
    ``/regex/`` terminals inlined (character classes and quantifiers carry over),
    ``//`` comments and ``%ignore`` / ``%import`` directives dropped.

    Raises:
        ValueError: when no rule is found or ``start`` is missing.
    """
    rules: list[list[str]] = []
    for raw in source.splitlines():
        line = re.sub(r"(^|\s)//.*$", "", raw).strip()
        if not line or line.startswith("%"):
            continue
        m = re.match(r"^\??([A-Za-z_][A-Za-z0-9_]*)(\.\d+)?\s*:(?!:)\s*(.*)$", line)
        if m:
            rules.append([m.group(1), m.group(3)])
        elif line.startswith("|") and rules:
            rules[-1][1] += " " + line
        else:
            raise ValueError(f"guided_grammar: cannot read Lark line {raw.strip()!r}")
    if not rules:
        raise ValueError("guided_grammar: no rules found")
    if not any(name == "start" for name, _ in rules):
        raise ValueError("guided_grammar: a Lark grammar needs a `start` rule")

    def body(text: str) -> str:
        text = re.sub(r"/((?:[^/\\]|\\.)+)/[imsx]*", r"(\1)", text)  # regex terminal
        return re.sub(r"\bstart\b", "root", text)

    return "\n".join(f"{'root' if n == 'start' else n} ::= {body(b)}" for n, b in rules)


class CompiledGrammar:
    """A compiled grammar; :meth:`new_matcher` starts one request's matcher."""

    def __init__(self, compiled: Any, stop_token_ids: list[int]) -> None:
        self._compiled = compiled
        self._stop_token_ids = stop_token_ids

    def new_matcher(self) -> GrammarMatcher:
        import xgrammar as xgr

        return GrammarMatcher(xgr.GrammarMatcher(
            self._compiled, override_stop_tokens=self._stop_token_ids or None))


class GrammarMatcher:
    """One request's position in its grammar. Not thread-safe (the engine thread owns it)."""

    def __init__(self, matcher: Any) -> None:
        self._m = matcher
        self.failed = False

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (only stop tokens once the
        grammar is complete)."""
        self._m.fill_next_token_bitmask(bitmask, row)

    def accept_token(self, token_id: int) -> bool:
        """Advance by ``token_id``; False (and ``failed``) when the grammar refuses it."""
        if self.failed or self._m.is_terminated():
            return False
        ok = self._m.accept_token(token_id)
        self.failed = not ok
        return ok

    def is_terminated(self) -> bool:
        return self._m.is_terminated()

    def jump_forward(self, max_tokens: int) -> list[int]:
        """Accept and return the tokens the grammar forces next (jump-forward decoding,
        Zheng et al., "SGLang", 2024, section 4): xgrammar's ``find_jump_forward_tokens``,
        the longest vocabulary tokens that spell the forced text, the last one dropped
        when a longer token extends it (the text after it is not forced, and the model
        may merge it). At most ``max_tokens``; none once the grammar is complete. The
        tokens are the library's split of the text, which may differ from the
        tokenizer's own encoding of it."""
        if max_tokens <= 0 or self.failed or self._m.is_terminated():
            return []
        forced = []
        for token_id in self._m.find_jump_forward_tokens()[:max_tokens]:
            if not self._m.accept_token(token_id):
                break
            forced.append(token_id)
        return forced


class GrammarCompilerCache:
    """Compiles :class:`StructuredOutputsParams` for one tokenizer, once per spec.

    Thread-safe: the server compiles in worker threads while the engine thread runs
    steps (xgrammar's compiler releases the GIL while it works). The tokenizer's
    token table is built on first use (~0.25 s for a 49k vocab).

    Args:
        tokenizer: a Hugging Face (fast) tokenizer.
        vocab_size: the width of the model's logits (may exceed the tokenizer's vocab).
        stop_token_ids: the ids that end the output once the grammar is complete.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(set(stop_token_ids))
        self._compiler = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], CompiledGrammar] = OrderedDict()
        self.num_compiles = 0

    def _get_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size,
                    stop_token_ids=self.stop_token_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    @staticmethod
    def cache_key(so: StructuredOutputsParams) -> tuple[str, str]:
        kind = so.kind
        value = getattr(so, kind)
        if kind == "json" and isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        return kind, json.dumps(value, sort_keys=True)

    def compile(self, so: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled grammar of ``so`` (cached; attached as ``so.compiled``).

        Raises:
            ValueError: an invalid schema, regex or grammar (the message names the field).
        """
        if so.compiled is not None:
            return so.compiled
        key = self.cache_key(so)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                so.compiled = hit
                return hit
        compiled = CompiledGrammar(self._compile(so), self.stop_token_ids)
        with self._lock:
            self.num_compiles += 1
            self._cache[key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        so.compiled = compiled
        return compiled

    def _compile(self, so: StructuredOutputsParams) -> Any:
        compiler = self._get_compiler()
        kind = so.kind
        try:
            if kind == "json":
                schema = so.json if isinstance(so.json, str) else json.dumps(so.json)
                return compiler.compile_json_schema(schema, any_whitespace=False)
            if kind == "json_object":
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if kind == "regex":
                return compiler.compile_regex(so.regex)
            if kind == "choice":
                alts = " | ".join(json.dumps(c) for c in so.choice)
                return compiler.compile_grammar(f"root ::= {alts}")
            grammar = so.grammar if "::=" in so.grammar else lark_to_ebnf(so.grammar)
            return compiler.compile_grammar(grammar)
        except ValueError:
            raise
        except Exception as e:  # xgrammar raises RuntimeError / its own errors on bad specs
            name = {"json": "json schema", "json_object": "json object"}.get(kind, kind)
            raise ValueError(f"structured_outputs.{kind}: invalid {name}: "
                             f"{str(e).strip().splitlines()[0][:500]}") from None
