"""Draft-model proposer: a smaller model with the target's vocabulary drafts ``k``
tokens autoregressively (Leviathan et al. 2023; vLLM's ``draft_model`` method).

Its paged KV cache has the target's block layout and is indexed by the *target's*
block tables, so the one :class:`~llmserve.kv_cache.KVCacheManager` allocates,
frees, preempts, copies-on-write and prefix-caches both at once (a block id means
the same tokens in both caches)::

    target key_cache [num_blocks, block_size, kv_heads_t, head_dim_t]   per target layer
    draft  key_cache [num_blocks, block_size, kv_heads_d, head_dim_d]   per draft layer
    request block table [7, 3, 12]  ->  the same slots in both

Per request the proposer remembers how many leading tokens have valid draft KV
(``valid``) and the drafts whose KV it wrote speculatively after them. Proposing
for a request with tokens ``t_0 .. t_{n-1}`` (``t_{n-1}`` just emitted):

    catch-up + first draft: forward t_valid .. t_{n-1}  -> sample d_1 at the last
    then for j = 2..k:      forward d_{j-1} at n+j-2    -> sample d_j

(all requests batched in each forward). Next step, the drafts the target accepted
keep their KV: ``valid`` grows by the longest common prefix of the written drafts
and the real tokens, so usually only the newest token is recomputed. KV slots
``n-1 .. n+k-2`` come from the scheduler's ``num_lookahead_tokens``. A resumed
(preempted) request recomputes its draft KV from position 0; a prefix-cache hit or
an ``n > 1`` fork trusts the shared blocks (a stale block can only lower the
acceptance rate: verification is lossless whatever the draft says).
"""

from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np
import torch

from llmserve.layers.attention import CommonAttentionMetadata
from llmserve.layers.batch_invariant import per_token_metadata
from llmserve.layers.sampler import build_sampling_metadata, random_sample
from llmserve.spec_decode.draft_vocab import pad_logits, restrict_draft_vocab
from llmserve.spec_decode.proposer import Proposer
from llmserve.spec_decode.rejection_sampler import target_probs

logger = logging.getLogger(__name__)
CATCH_UP_AS_DECODE = 8  # a draft row of at most this many tokens runs as one-token decodes


def load_draft_model(config, tokenizer) -> torch.nn.Module:
    """Load ``speculative_config.model`` with the target's dtype, device and backend.

    Raises:
        ValueError: naming ``speculative_config.model`` when the draft cannot be
            loaded, has another vocabulary size or a shorter context than ``max_model_len``.
    """
    from llmserve.layers.quantization import resolve_quantization
    from llmserve.loader import (
        checkpoint_quantization,
        iter_weights,
        load_model_config,
        resolve_model,
    )
    from llmserve.loader.gguf_loader import gguf_tensor_types
    from llmserve.models import get_model_class
    from llmserve.worker.model_runner import TORCH_DTYPES

    sc = config.speculative_config
    try:
        source = resolve_model(sc.model)
        draft_config = load_model_config(source)
    except ValueError as e:
        raise ValueError(f"speculative_config.model {sc.model!r}: {e}") from None
    check_draft_config(draft_config, config)
    draft_config = replace(draft_config, max_model_len=config.scheduler_config.max_model_len)
    quant = resolve_quantization(
        sc.quantization, model_kind=source.kind, dtype=config.dtype, device=config.device,
        checkpoint=checkpoint_quantization(source),
        gguf_types=(set(gguf_tensor_types(source.path).values()) if source.kind == "gguf"
                    else None), deterministic=config.deterministic)
    model_cls = get_model_class(draft_config.architecture)
    with torch.device(config.device):
        model = model_cls(draft_config, TORCH_DTYPES[config.dtype], config.attention_backend)
    weights = iter_weights(source, draft_config, quantization=quant)
    if sc.draft_vocab_size is not None:
        weights = restrict_draft_vocab(model, sc.draft_vocab_size, weights)
    model.load_weights(weights)
    if quant is not None:
        quant.process_model(model)
        quant.fix_layouts(model)
    model.eval()
    logger.info("draft model %s (%s, %d layers, weights %s, scoring %d of %d ids)",
                source.name, draft_config.architecture, draft_config.num_hidden_layers,
                quant.name if quant else "dense",
                sc.draft_vocab_size or draft_config.vocab_size, draft_config.vocab_size)
    return model


def check_draft_config(draft_config, config) -> None:
    """The draft must score the target's vocabulary and hold ``max_model_len`` tokens.

    Raises:
        ValueError: naming ``speculative_config.model``.
    """
    target = config.model_config
    if draft_config.vocab_size != target.vocab_size:
        raise ValueError(
            f"speculative_config.model: the draft's vocabulary ({draft_config.vocab_size} "
            f"tokens) differs from the target's ({target.vocab_size}); a draft must share "
            "the target's tokenizer")
    num_ids = getattr(config.speculative_config, "draft_vocab_size", None)
    if num_ids is not None and num_ids > target.vocab_size:
        raise ValueError(f"speculative_config.draft_vocab_size ({num_ids}) exceeds the "
                         f"vocabulary ({target.vocab_size})")
    max_len = config.scheduler_config.max_model_len
    if draft_config.max_context_len < max_len:
        raise ValueError(
            f"speculative_config.model: the draft's context length "
            f"({draft_config.max_context_len}) is shorter than max_model_len ({max_len}); "
            "lower --max-model-len or pick another draft")


class DraftModelProposer(Proposer):
    """Drafts with a second model over the target's block tables (module docstring).

    Args:
        config: the engine config (``speculative_config.num_speculative_tokens`` = k).
        runner: the target's model runner (block size, block count, device, dtype).
        model: the loaded draft model (``forward``, ``compute_logits``, ``attn_backend_cls``).
    """

    needs_draft_probs = True

    def __init__(self, config, runner, model: torch.nn.Module) -> None:
        dc = model.config
        check_draft_config(dc, config)
        self.model = model
        self.k = config.speculative_config.num_speculative_tokens
        self.num_lookahead_tokens = self.k
        self.block_size = runner.block_size
        self.device = runner.device
        self.vocab_size = dc.vocab_size
        self.eos_token_ids = runner.eos_token_ids
        self.sliding_window = getattr(model, "sliding_window", dc.sliding_window)
        shape = (runner.num_blocks, self.block_size, dc.num_key_value_heads, dc.head_dim)
        # per draft layer: key_cache, value_cache  # [num_blocks, block_size, kv_heads, head_dim]
        self.kv_caches = [(torch.zeros(shape, dtype=runner.dtype, device=self.device),
                           torch.zeros(shape, dtype=runner.dtype, device=self.device))
                          for _ in range(dc.num_hidden_layers)]
        self.valid: dict[str, int] = {}  # leading tokens whose draft KV is valid
        self.written: dict[str, list[int]] = {}  # drafts whose KV follows them
        self.probs: dict[str, torch.Tensor] = {}  # q of the last drafts, [k_i, V]

    # ------------------------------------------------------------ bookkeeping
    def begin_step(self, runner, sched) -> None:
        for req_id in sched.finished_req_ids:
            self._drop(req_id)
        for new in sched.scheduled_new_reqs:  # prefix hits / forks: trust shared blocks
            self._drop(new.req_id)
            self.valid[new.req_id] = new.num_computed_tokens
        for cached in sched.scheduled_cached_reqs:
            if cached.resumed_from_preemption:  # blocks changed (or were swapped)
                self._drop(cached.req_id)
        for req_id in sched.preempted_req_ids:
            self._drop(req_id)

    def _drop(self, req_id: str) -> None:
        self.valid.pop(req_id, None)
        self.written.pop(req_id, None)
        self.probs.pop(req_id, None)

    def apply_kv_cache_ops(self, ops) -> None:
        """Mirror copy-on-write copies (swapped requests recompute their draft KV)."""
        copies = [(s, d) for kind, s, d in ops if kind == "copy"]
        if not copies:
            return
        for src, dst in copies:  # in order: a later copy may read an earlier one's dst
            for kc, vc in self.kv_caches:
                kc[dst].copy_(kc[src])
                vc[dst].copy_(vc[src])

    def draft_probs(self, req_id: str, num: int) -> torch.Tensor:
        q = self.probs.get(req_id)
        if q is None:  # a greedy request: q is unused by the verifier
            return torch.zeros(num, self.vocab_size, device=self.device)
        return q[:num]

    # ------------------------------------------------------------ propose
    def propose(self, states, num_drafts):
        bs = self.block_size
        jobs = []  # (state, k, first position to compute, tokens)
        for state, k in zip(states, num_drafts):
            self.probs.pop(state.req_id, None)
            n = len(state.token_ids)
            k = min(k, len(state.block_ids) * bs - n + 1)  # the slots the scheduler gave
            if k <= 0:
                continue
            valid = self.valid.get(state.req_id, 0)
            written = self.written.get(state.req_id, [])
            real = state.token_ids[valid:valid + len(written)]
            common = 0
            while common < len(real) and real[common] == written[common]:
                common += 1
            start = min(valid + common, n - 1)
            jobs.append((state, k, start))
        drafts: dict[str, list[int]] = {}
        self.last_propose_prefilled = any(len(s.token_ids) - start > CATCH_UP_AS_DECODE
                                          for s, _, start in jobs)
        if not jobs:
            return [[] for _ in states]
        # step 1: catch up on every token without draft KV, sample d_1 at the last
        inputs = [(s, list(range(start, len(s.token_ids))), s.token_ids[start:])
                  for s, _, start in jobs]
        tokens, q = self._forward_and_sample(inputs)
        for (s, _, _), t, qi in zip(jobs, tokens, q):
            drafts[s.req_id] = [t]
            self.probs[s.req_id] = [qi]
        # steps 2..k: one token each for the requests still drafting
        for j in range(1, max(k for _, k, _ in jobs)):
            live = [(s, k) for s, k, _ in jobs if k > j]
            if not live:
                break
            inputs = [(s, [len(s.token_ids) + j - 1], [drafts[s.req_id][-1]]) for s, _ in live]
            tokens, q = self._forward_and_sample(inputs)
            for (s, _), t, qi in zip(live, tokens, q):
                drafts[s.req_id].append(t)
                self.probs[s.req_id].append(qi)
        for s, _, _ in jobs:
            d = drafts[s.req_id]
            self.valid[s.req_id] = len(s.token_ids)
            self.written[s.req_id] = d[:-1]  # KV written at positions n .. n+k-2
            qs = self.probs.pop(s.req_id)
            if qs[0] is not None:
                self.probs[s.req_id] = torch.stack(qs)
        return [drafts.get(s.req_id, []) for s in states]

    def _forward_and_sample(self, inputs):
        """One batched draft forward. ``inputs``: (state, positions, token ids) per request.
        Returns the sampled token and its ``q`` row (None for greedy) per request."""
        bs = self.block_size
        # short rows (a decode, or a catch-up on the few tokens the target accepted) first:
        # they run as one-token decodes through the decode path's packed kernels, not
        # the prompt path (gguf-hybrid's dense copy: 100 ms a catch-up on the 0.5B)
        order = sorted(range(len(inputs)), key=lambda i: len(inputs[i][1]) > CATCH_UP_AS_DECODE)
        ids, pos_all, slots, qlens, seq_lens = [], [], [], [], []
        max_blocks = max(len(inputs[i][0].block_ids) for i in order)
        block_table = np.zeros((len(order), max_blocks), dtype=np.int64)
        for row, i in enumerate(order):
            state, positions, toks = inputs[i]
            blocks = np.asarray(state.block_ids, dtype=np.int64)
            block_table[row, :len(blocks)] = blocks
            pos = np.asarray(positions, dtype=np.int64)
            ids.extend(toks)
            pos_all.append(pos)
            slots.append(blocks[pos // bs] * bs + pos % bs)
            qlens.append(len(positions))
            seq_lens.append(int(pos[-1]) + 1)
        qsl = np.zeros(len(qlens) + 1, dtype=np.int64)
        np.cumsum(qlens, out=qsl[1:])
        short = sum(1 for q in qlens if q <= CATCH_UP_AS_DECODE)
        num_decodes = int(qsl[short])
        mqlens, mseq = qlens, seq_lens
        if num_decodes > short:  # the short rows as one-token decodes, one per token
            ql, sl, table = per_token_metadata(qlens[:short],
                                               np.concatenate(pos_all[:short]),
                                               block_table[:short])
            mqlens, mseq = ql + qlens[short:], sl + seq_lens[short:]
            block_table = np.concatenate([table, block_table[short:]])
        mqsl = np.zeros(len(mqlens) + 1, dtype=np.int64)
        np.cumsum(mqlens, out=mqsl[1:])
        dev = self.device
        common = CommonAttentionMetadata(
            query_start_loc=torch.from_numpy(mqsl).to(dev),
            seq_lens=torch.tensor(mseq, dtype=torch.long, device=dev),
            block_table=torch.from_numpy(block_table).to(dev),
            slot_mapping=torch.from_numpy(np.concatenate(slots)).to(dev),
            query_lens=mqlens, seq_lens_list=mseq, num_decodes=num_decodes,
            max_query_len=max(mqlens), max_seq_len=max(mseq), block_size=bs,
            sliding_window=self.sliding_window)
        attn_metadata = self.model.attn_backend_cls.build_metadata(common)
        hidden = self.model(torch.tensor(ids, dtype=torch.long, device=dev),
                            torch.from_numpy(np.concatenate(pos_all)).to(dev),
                            self.kv_caches, attn_metadata)
        last = torch.from_numpy(qsl[1:] - 1).to(dev)
        logits = pad_logits(self.model.compute_logits(hidden[last]).to(torch.float32),
                            self.vocab_size)  # [B, V]
        states = [inputs[i][0] for i in order]
        meta = build_sampling_metadata(
            [s.sampling_params for s in states], [[]] * len(states), [[]] * len(states),
            [s.generator for s in states], (), self.vocab_size, dev)
        greedy = logits.argmax(dim=-1)
        q_rows: list[torch.Tensor | None] = [None] * len(states)
        if not meta.all_greedy:
            q = target_probs(logits, meta)
            sampled = random_sample(q, meta.generators)
            greedy = torch.where(meta.temperature == 0, greedy, sampled)
            q_rows = [None if t == 0 else q[r] for r, t in enumerate(meta.temperature.tolist())]
        out_tokens = greedy.tolist()
        tokens: list[int] = [0] * len(inputs)
        qs: list[torch.Tensor | None] = [None] * len(inputs)
        for row, i in enumerate(order):
            tokens[i] = out_tokens[row]
            qs[i] = q_rows[row]
        return tokens, qs
