"""AWQ on the real default model (SmolLM2-135M, first decoder layers) against RTN.

The regression this guards: AWQ folded a group's ``1/s`` into a producer linear
(``up_proj`` for ``down_proj``) after that producer had been rounded, so the
checkpoint's codes lacked the fold (perplexity 5e6 on the full model) while every
in-memory check passed. Here the quantized layers are rebuilt from exactly what a
checkpoint stores (each ``QuantizedLinear``'s dequantized codes plus the folded norms),
and the oracle is the float model itself: on evaluation text (not the calibration
text) AWQ's block output error and next-token KL must be below RTN's.
"""

from __future__ import annotations

import copy

import pytest
import torch

from llmserve.compress.pipeline import QuantizeOptions, quantize_model
from llmserve.compress.quantizer import QuantizedLinear

pytestmark = pytest.mark.model
NUM_LAYERS = 3


def _shallow(module: torch.nn.Module) -> torch.nn.Module:
    """A copy sharing tensors but with its own child table (setattr leaves the original)."""
    out = copy.copy(module)
    out._modules = dict(module._modules)
    return out


@pytest.fixture(scope="module")
def truncated(hf_model):
    """A float copy of the default model with its first NUM_LAYERS decoder layers."""
    model = _shallow(hf_model)
    model.model = _shallow(hf_model.model)
    model.model.layers = torch.nn.ModuleList(hf_model.model.layers[:NUM_LAYERS])
    model.config = copy.deepcopy(hf_model.config)
    model.config.num_hidden_layers = NUM_LAYERS
    return model


@pytest.fixture(scope="module")
def token_ids(gguf_path):
    from llmserve.compress.quantize import calibration_ids
    from llmserve.compress.texts import builtin_text, token_windows
    from llmserve.loader import resolve_model
    from llmserve.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model(gguf_path))
    calib = calibration_ids(tok, None, 4, 128)
    ids = tok.encode(builtin_text("eval"), add_special_tokens=False)
    evals = torch.tensor(token_windows(ids, 128, bos_token_id=tok.bos_token_id)[:3])
    return calib, evals


def _as_checkpoint(truncated, method: str, calib) -> torch.nn.Module:
    """Quantize a copy (layers deep-copied: scales fold into norms in place) and set
    every linear to what the checkpoint holds for it."""
    model = _shallow(truncated)
    model.model = _shallow(truncated.model)
    model.model.layers = copy.deepcopy(truncated.model.layers)
    qm = quantize_model(model, QuantizeOptions(method, 4, 64), calib, progress=False)
    with torch.no_grad():
        for name, q in qm.weights.items():
            assert isinstance(q, QuantizedLinear)
            model.get_submodule(name).weight.copy_(q.dequantize())
    return model


def test_awq_beats_rtn_on_default_model_layers(truncated, token_ids):
    calib, evals = token_ids
    with torch.no_grad():
        ref = truncated(evals, output_hidden_states=True)
        results = {}
        for method in ("rtn", "awq"):
            out = _as_checkpoint(truncated, method, calib)(evals, output_hidden_states=True)
            hid, ref_hid = out.hidden_states[-1], ref.hidden_states[-1]  # [S, L, H]
            rel = float((hid - ref_hid).norm() / ref_hid.norm())
            ref_logp = torch.log_softmax(ref.logits.double(), -1)
            logp = torch.log_softmax(out.logits.double(), -1)
            kl = float((ref_logp.exp() * (ref_logp - logp)).sum(-1).mean())
            results[method] = (rel, kl)
    print("relative hidden error, KL:", results)
    (rel_rtn, kl_rtn), (rel_awq, kl_awq) = results["rtn"], results["awq"]
    # measured (3 layers, 3x128 eval tokens): RTN (0.118, 0.038), AWQ (0.089, 0.026)
    assert rel_awq < rel_rtn, results
    assert kl_awq < kl_rtn, results
    assert kl_rtn < 1.0, results  # the harness itself is sane: RTN w4 g64 stays close
