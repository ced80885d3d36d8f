"""ModelRunner: SchedulerOutput -> tensors -> forward -> sampled tokens.

The KV cache tensors live here: per layer a pair (key_cache, value_cache),
each ``[num_blocks, block_size, num_kv_heads, head_dim]`` in the model dtype.
The runner keeps a small state per request (its tokens, block table,
sampling parameters and seeded generator) and each step turns the
scheduler's plain lists into flat input tensors::

    requests (decodes first):   A(decode)  B(chunk 5..12)   C(prefill 0..6)
    input_ids / positions:      [a8]       [b5 .. b12]      [c0 .. c6]
    query_start_loc:            0,         1,               9,             16
    slot_mapping[t] = block_table[pos // block_size] * block_size + pos % block_size
    logits_indices: the last token of each request that reaches its end this step
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from llmserve.config import EngineConfig
from llmserve.layers.attention import CommonAttentionMetadata
from llmserve.layers.attention.kv_quant import kv_cache_shapes
from llmserve.layers.batch_invariant import per_token_metadata
from llmserve.layers.sampler import Sampler, build_sampling_metadata
from llmserve.sampling_params import SamplingParams
from llmserve.scheduler.output import ModelRunnerOutput, SchedulerOutput
from llmserve.structured_output import allocate_bitmask
from llmserve.worker.kv_transfer import fill_blocks
from llmserve.worker.prompt_logprobs import collect_prompt_logprobs, wants_prompt_logprobs
from llmserve.worker.window_kv import resolve_window_kv, window_layout, window_rows

logger = logging.getLogger(__name__)

# most grammar-forced tokens appended after one sampled token: the next step computes
# them, so each constrained request adds at most 1 + this many rows to a step that other
# requests share (benchmarks/structured_output_overhead.py; a longer run takes more jumps)
MAX_JUMP_FORWARD_TOKENS = 8
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _lora_id(state) -> int:
    return 0 if state.lora_request is None else state.lora_request.lora_int_id


@dataclass
class CachedRequestState:
    """The runner's copy of a request: all its tokens (prompt + sampled)."""

    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    generator: torch.Generator | None
    block_ids: list[int]
    num_computed_tokens: int
    prompt_logprobs: list | None = None  # entries of prompt tokens 1.. (prompt_logprobs.py)
    grammar: Any = None  # structured outputs: a GrammarMatcher, advanced by each token
    lora_request: Any = None  # a llmserve.lora.LoRARequest (None: the base model)
    # KV eviction / sliding window: tokens whose blocks left the table (whole blocks
    # before the kept ones); position p lives in block_ids[(p - this) // block_size]
    num_evicted_tokens: int = 0
    # a mixed model's local layers: (first logical block, window-pool ids), or None
    window_blocks: tuple[int, list[int]] | None = None

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


class ModelRunner:
    """Runs one model on one device with a paged KV cache.

    Args:
        config: the engine configuration.
        model: an ``nn.Module`` with ``forward(input_ids, positions, kv_caches,
            attn_metadata)``, ``compute_logits`` and ``attn_backend_cls``.
        num_blocks: KV cache blocks per layer (block 0 is the null block).
    """

    is_driver = True  # False on tensor-parallel followers: they compute, rank 0 samples

    def __init__(self, config: EngineConfig, model: torch.nn.Module, num_blocks: int,
                 num_host_blocks: int = 0) -> None:
        self.config = config
        self.model = model
        self.device = torch.device(config.device)
        self.dtype = TORCH_DTYPES[config.dtype]
        self.block_size = config.cache_config.block_size
        self.num_blocks = num_blocks
        mc = config.model_config
        self.vocab_size = mc.vocab_size
        self.eos_token_ids = set(mc.eos_token_ids)
        # the step-wide window the model asks for (None when its layers carry their own)
        self.sliding_window = getattr(model, "sliding_window", mc.sliding_window)
        # the cache dtype: the model's, another float, or int8 / fp8 pages whose head rows
        # carry their fp16 scale (layers/attention/kv_quant.py: head_dim + 2 bytes); this
        # rank's KV heads (a tensor-parallel shard holds max(1, kv_heads / tp))
        # (--kv-key-quant per-channel: int8 keys in blocks of block_size + 2 rows, the
        # last two the block's per-channel scales; kv_quant_pc.py)
        key_quant = getattr(getattr(config, "cache_config", None), "kv_key_quant",
                            "per-token")
        self.kv_cache_dtype, key_shape, shape = kv_cache_shapes(
            getattr(config, "kv_cache_dtype", config.dtype), self.dtype, key_quant,
            num_blocks, self.block_size, getattr(model, "num_kv_heads", mc.num_key_value_heads),
            mc.head_dim)
        # per layer of this pipeline stage: key_cache, value_cache
        # [num_blocks, block_size, num_kv_heads, head_dim], on that layer's device (a layer
        # split keeps the CPU layers' KV in host memory)
        num_layers = getattr(model, "num_layers", mc.num_hidden_layers)
        layer_devices = getattr(model, "layer_devices", None) or [self.device] * num_layers
        # a mixed model's local layers: [window pool blocks, ...] (worker/window_kv.py)
        self.window_kv = resolve_window_kv(config)[0]
        self.window_layers = set(self.window_kv.layers) if self.window_kv else set()
        window_shapes = kv_cache_shapes(
            getattr(config, "kv_cache_dtype", config.dtype), self.dtype, key_quant,
            self.window_kv.num_blocks, self.block_size,
            getattr(model, "num_kv_heads", mc.num_key_value_heads),
            mc.head_dim)[1:] if self.window_kv else None
        shapes = [window_shapes if i in self.window_layers else (key_shape, shape)
                  for i in range(num_layers)]
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = [
            (torch.zeros(ks, dtype=self.kv_cache_dtype, device=dev),
             torch.zeros(vs, dtype=self.kv_cache_dtype, device=dev))
            for (ks, vs), dev in zip(shapes, layer_devices, strict=True)
        ]
        # the host pool for swap preemption, same layout; block 0 unused
        pin = self.device.type == "cuda"
        self.host_kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        if num_host_blocks > 0:
            host_shape = (num_host_blocks + 1, *shape[1:])
            host_key_shape = (num_host_blocks + 1, *key_shape[1:])
            self.host_kv_caches = [
                (torch.zeros(host_key_shape, dtype=self.kv_cache_dtype, pin_memory=pin),
                 torch.zeros(host_shape, dtype=self.kv_cache_dtype, pin_memory=pin))
                for _ in range(num_layers)
            ]
        self.sampler = Sampler()
        self.requests: dict[str, CachedRequestState] = {}
        self.spec_decoder = None  # a spec_decode.verifier.SpecDecoder: runs the step instead
        self.lora_manager = None  # a lora.manager.LoRAModelManager (--enable-lora)

    # ---------------------------------------------------------------- KV moves
    def apply_kv_cache_ops(self, ops: list[tuple[str, int, int]]) -> None:
        """Copy-on-write copies and swaps, in order (batched while independent)."""
        i = 0
        while i < len(ops):
            kind = ops[i][0]
            srcs: list[int] = []
            dsts: list[int] = []
            while i < len(ops) and ops[i][0] == kind and ops[i][1] not in dsts \
                    and ops[i][2] not in srcs and ops[i][2] not in dsts:
                srcs.append(ops[i][1])
                dsts.append(ops[i][2])
                i += 1
            self._move_blocks(kind, srcs, dsts)

    def _move_blocks(self, kind: str, srcs: list, dsts: list[int]) -> None:
        if kind == "load":  # the shared KV store: srcs are block bodies (bytes)
            fill_blocks(self.kv_caches, srcs, dsts)
            return
        host = torch.device("cpu")
        src_dev = host if kind == "swap_in" else self.device
        dst_dev = host if kind == "swap_out" else self.device
        src_idx = torch.tensor(srcs, dtype=torch.long, device=src_dev)
        dst_idx = torch.tensor(dsts, dtype=torch.long, device=dst_dev)
        for layer, (kc, vc) in enumerate(self.kv_caches):
            if layer in self.window_layers:  # the window pool shares no blocks
                continue
            if kind == "copy":
                src_pair, dst_pair = (kc, vc), (kc, vc)
            elif kind == "swap_out":
                src_pair, dst_pair = (kc, vc), self.host_kv_caches[layer]
            elif kind == "swap_in":
                src_pair, dst_pair = self.host_kv_caches[layer], (kc, vc)
            else:
                raise ValueError(f"unknown KV cache op {kind!r}")
            for src_t, dst_t in zip(src_pair, dst_pair):  # (a layer split: per-layer device)
                blocks = src_t.index_select(0, src_idx.to(src_t.device)).to(dst_t.device,
                                                                            non_blocking=True)
                dst_t.index_copy_(0, dst_idx.to(dst_t.device), blocks)

    # ---------------------------------------------------------------- state
    def _update_states(self, sched: SchedulerOutput) -> None:
        for req_id in sched.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in sched.scheduled_new_reqs:
            sp = new.sampling_params
            gen = None
            if sp.seed is not None:
                gen = torch.Generator(device=self.device)
                gen.manual_seed(sp.seed)
            self.requests[new.req_id] = CachedRequestState(
                new.req_id, list(new.prompt_token_ids), len(new.prompt_token_ids), sp, gen,
                list(new.block_ids), new.num_computed_tokens,
                [] if sp.prompt_logprobs is not None else None,
                lora_request=getattr(new, "lora_request", None))
            self.requests[new.req_id].num_evicted_tokens = new.num_evicted_tokens
            self.requests[new.req_id].window_blocks = new.window_blocks
            so = sp.structured_outputs
            if so is not None:  # compiled by the engine when the request was added
                self.requests[new.req_id].grammar = so.compiled.new_matcher()
        for cached in sched.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            state.block_ids = list(cached.block_ids)
            state.num_computed_tokens = cached.num_computed_tokens
            state.num_evicted_tokens = cached.num_evicted_tokens
            state.window_blocks = cached.window_blocks

    def drop_request(self, req_id: str) -> None:
        self.requests.pop(req_id, None)

    # ---------------------------------------------------------------- inputs
    def _prepare_inputs(self, sched: SchedulerOutput):
        num_sched = sched.num_scheduled_tokens
        # decodes (tokens past the prompt) first, then prefill chunks; a one-token prompt
        # chunk (the rest of a prefix-cache hit, a chunk boundary) is a prefill, so a
        # prompt token runs the prompt path's kernels wherever its chunk starts; output
        # tokens recomputed after a preemption (the scheduler never mixes them with
        # prompt tokens in one chunk) run as one-token decodes, as they first ran
        decode = {r: self.requests[r].num_computed_tokens
                  >= self.requests[r].num_prompt_tokens for r in num_sched}
        # within each group, rows of one LoRA adapter together: each adapter's rows are
        # then one contiguous slice (one shrink and one in-place expand per layer)
        order = sorted(num_sched, key=lambda r: (not decode[r], _lora_id(self.requests[r])))
        states = [self.requests[r] for r in order]
        query_lens = [num_sched[r] for r in order]
        num_decode_seqs = sum(decode.values())
        bs = self.block_size
        ids_parts, pos_parts, slot_parts = [], [], []
        seq_lens, logits_idx, sample_states = [], [], []
        max_blocks = max(len(s.block_ids) for s in states)
        block_table = np.zeros((len(states), max_blocks), dtype=np.int64)
        offset = 0
        cpos_parts = []  # positions in the kept blocks (true positions minus evicted)
        self._layout = []  # (state, first row, first position, tokens): prompt logprobs
        for i, (state, qlen) in enumerate(zip(states, query_lens)):
            start = state.num_computed_tokens
            end = start + qlen
            self._layout.append((state, offset, start, qlen))
            ids_parts.append(state.token_ids[start:end])
            pos = np.arange(start, end, dtype=np.int64)
            blocks = np.asarray(state.block_ids, dtype=np.int64)
            block_table[i, :len(blocks)] = blocks
            pos_parts.append(pos)
            cpos = pos - state.num_evicted_tokens  # RoPE keeps `pos`; slots and masks: kept
            cpos_parts.append(cpos)
            slot_parts.append(blocks[cpos // bs] * bs + cpos % bs)
            seq_lens.append(end - state.num_evicted_tokens)
            offset += qlen
            if end == len(state.token_ids):  # reached the end: sample the next token
                logits_idx.append(offset - 1)
                sample_states.append(state)
        input_ids = torch.tensor([t for part in ids_parts for t in part], dtype=torch.long)
        pos_np = np.concatenate(pos_parts)
        positions = torch.from_numpy(pos_np)
        cpos_np = np.concatenate(cpos_parts)  # positions in the kept blocks
        window = None  # a mixed model's local layers: their table and slots (window_kv.py)
        if self.window_kv is not None:
            window = window_rows(states, pos_parts, max_blocks, bs)
        if getattr(self.config, "deterministic", False):  # each token a one-token decode
            num_decode_seqs = len(query_lens)
        num_decodes = sum(query_lens[:num_decode_seqs])
        if num_decodes > num_decode_seqs:  # a decode group with recomputed output tokens
            ql, sl, table = per_token_metadata(query_lens[:num_decode_seqs],
                                               cpos_np[:num_decodes],
                                               block_table[:num_decode_seqs])
            if window is not None:
                wtable = per_token_metadata(query_lens[:num_decode_seqs], cpos_np[:num_decodes],
                                            window[0][:num_decode_seqs])[2]
                window = (np.concatenate([wtable, window[0][num_decode_seqs:]]), window[1])
            query_lens = ql + query_lens[num_decode_seqs:]
            seq_lens = sl + seq_lens[num_decode_seqs:]
            block_table = np.concatenate([table, block_table[num_decode_seqs:]])
        qsl = np.zeros(len(query_lens) + 1, dtype=np.int64)
        np.cumsum(query_lens, out=qsl[1:])
        common = CommonAttentionMetadata(
            query_start_loc=torch.from_numpy(qsl).to(self.device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.long, device=self.device),
            block_table=torch.from_numpy(block_table).to(self.device),
            slot_mapping=torch.from_numpy(np.concatenate(slot_parts)).to(self.device),
            query_lens=query_lens,
            seq_lens_list=seq_lens,
            num_decodes=num_decodes,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            block_size=bs,
            sliding_window=self.sliding_window,
            window_layout=None if window is None else window_layout(
                self.window_kv.window, *window, self.device),
        )
        self._scored = self._block_score_requests(sched, states, common)
        return (input_ids.to(self.device), positions.to(self.device), common,
                torch.tensor(logits_idx, dtype=torch.long, device=self.device), sample_states)

    def _block_score_requests(self, sched: SchedulerOutput, states: list, common) -> dict:
        """KV eviction (H2O, SnapKV): ``{req_id: BlockScoreRequest}`` for the requests
        whose attention the scheduler wants summed per block; set on ``common``."""
        if not sched.kv_score_from or getattr(self.config, "deterministic", False):
            return {}
        from llmserve.layers.attention.scored import BlockScoreRequest

        wanted: dict[int, BlockScoreRequest] = {}
        by_req = {}
        for i, state in enumerate(states):
            first = sched.kv_score_from.get(state.req_id)
            if first is None:
                continue
            req = BlockScoreRequest(max(0, first - state.num_computed_tokens), torch.zeros(
                len(state.block_ids), dtype=torch.float32, device=self.device))
            wanted[i] = by_req[state.req_id] = req
        if wanted:
            common.block_scores = wanted
        return by_req

    # ---------------------------------------------------------------- execute
    def _run_model(self, input_ids: torch.Tensor, positions: torch.Tensor,
                   attn_metadata) -> torch.Tensor | None:
        """The forward pass: final hidden states ``[num_tokens, hidden_size]``, or None on
        a pipeline stage that is not the last (worker/pp_worker.py)."""
        return self.model(input_ids, positions, self.kv_caches, attn_metadata)

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step: forward over every scheduled token, sample where due."""
        if self.spec_decoder is not None:  # speculative decoding: verify drafts, propose
            return self.spec_decoder.execute_model(self, sched)
        self._update_states(sched)
        if sched.kv_cache_ops:
            self.apply_kv_cache_ops(sched.kv_cache_ops)
        out = ModelRunnerOutput()
        if sched.total_num_scheduled_tokens == 0:
            return out
        input_ids, positions, common, logits_idx, sample_states = self._prepare_inputs(sched)
        attn_metadata = self.model.attn_backend_cls.build_metadata(common)
        if self.lora_manager is not None:  # each row's adapter slot (lora/layers.py)
            self.lora_manager.prepare_step([(s.lora_request, n) for s, _, _, n in self._layout],
                                           common.num_decodes)
        hidden = self._run_model(input_ids, positions, attn_metadata)
        if hidden is None:  # a pipeline stage before the last: sent on, nothing to sample
            return out
        for req_id, scored in self._scored.items():
            out.kv_block_scores[req_id] = scored.scores.tolist()
        if wants_prompt_logprobs(self._layout):
            collect_prompt_logprobs(self.model, hidden, self._layout)
        if not sample_states:
            return out
        # [num_reqs_sampled, vocab] (a layer split ends on the CPU: back to the device)
        logits = self.model.compute_logits(hidden[logits_idx.to(hidden.device)]).to(self.device)
        if not self.is_driver:
            return out
        metadata = build_sampling_metadata(
            [s.sampling_params for s in sample_states],
            [s.token_ids[:s.num_prompt_tokens] for s in sample_states],
            [s.output_token_ids for s in sample_states],
            [s.generator for s in sample_states],
            self.eos_token_ids, self.vocab_size, self.device)
        grammar_rows = [i for i, s in enumerate(sample_states) if s.grammar is not None]
        if grammar_rows:  # structured outputs: each row's allowed next tokens
            bitmask = allocate_bitmask(len(grammar_rows), self.vocab_size)
            for k, i in enumerate(grammar_rows):
                sample_states[i].grammar.fill_bitmask(bitmask, k)
            metadata.token_bitmask = bitmask
            metadata.token_bitmask_rows = torch.tensor(grammar_rows, dtype=torch.long)
        sampler_out = self.sampler(logits, metadata)
        tokens = sampler_out.sampled_token_ids.tolist()
        lp_ids = lps = ranks = None
        if sampler_out.logprobs is not None:
            lp_ids = sampler_out.logprob_token_ids.tolist()
            lps = sampler_out.logprobs.tolist()
            ranks = sampler_out.sampled_token_ranks.tolist()
        for i, (state, tok) in enumerate(zip(sample_states, tokens)):
            if state.sampling_params.prompt_logprobs is not None \
                    and len(state.token_ids) == state.num_prompt_tokens:
                out.prompt_logprobs[state.req_id] = state.prompt_logprobs  # None: unavailable
            n = state.sampling_params.logprobs
            state.token_ids.append(tok)
            out.sampled_token_ids[state.req_id] = tok
            if state.grammar is not None:
                if not state.grammar.accept_token(tok):
                    if not state.grammar.is_terminated():
                        logger.warning("request %s: token %d refused by its grammar",
                                       state.req_id, tok)
                elif self.config.jump_forward and n is None:
                    self._jump_forward(state, tok, out)
            if n is not None and lp_ids is not None:
                out.logprobs[state.req_id] = (lp_ids[i][:n + 1], lps[i][:n + 1], ranks[i])
        return out

    def _jump_forward(self, state: CachedRequestState, tok: int,
                      out: ModelRunnerOutput) -> None:
        """Append the tokens ``state``'s grammar forces after its sampled ``tok``: emitted
        now, computed by the next step as one multi-token chunk (not one step each).
        Not for requests that want logprobs (forced tokens have none)."""
        # the scheduler ends the request at max_tokens / max_model_len inside the run too
        room = [MAX_JUMP_FORWARD_TOKENS]
        if state.sampling_params.max_tokens is not None:
            room.append(state.sampling_params.max_tokens - len(state.output_token_ids))
        if self.config.model_config.max_model_len:
            room.append(self.config.model_config.max_model_len - len(state.token_ids))
        forced = state.grammar.jump_forward(min(room))
        if forced:
            state.token_ids.extend(forced)
            out.emitted_token_ids[state.req_id] = [tok, *forced]
            out.sampled_token_ids[state.req_id] = forced[-1]
