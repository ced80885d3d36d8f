"""Structured outputs: grammars compiled once per spec, token masks applied in the sampler.

See :mod:`llmserve.structured_output.xgrammar_backend` for the library choice.
"""

from llmserve.structured_output.xgrammar_backend import (
    CompiledGrammar,
    GrammarCompilerCache,
    GrammarMatcher,
    allocate_bitmask,
)

__all__ = ["CompiledGrammar", "GrammarCompilerCache", "GrammarMatcher", "allocate_bitmask"]
