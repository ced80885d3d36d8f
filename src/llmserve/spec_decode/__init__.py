"""Speculative decoding: proposers (n-gram prompt lookup, draft model), the lossless
rejection sampler and acceptance metrics.

Importing this package does not import torch (:mod:`.config` and :mod:`.ngram` are
pure); the torch parts live in :mod:`.rejection_sampler`, :mod:`.verifier` and
:mod:`.draft_model`.
"""

from llmserve.spec_decode.config import SpeculativeConfig
from llmserve.spec_decode.metrics import SpecDecodingStats
from llmserve.spec_decode.ngram import ngram_propose

__all__ = ["SpecDecodingStats", "SpeculativeConfig", "ngram_propose"]
