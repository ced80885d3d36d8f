"""One engine step with speculative decoding, run in place of
``ModelRunner.execute_model`` (the runner delegates here when speculation is on).

::

    scheduler: decode of A scheduled as [a_last, d1, d2, d3]  (+ lookahead slots)
    runner:    forward over every scheduled token (prefill chunks of others mixed in)
               logits at A's 4 positions -> rejection sampler -> A emits [d1, d2, y]
    proposer:  drafts for A's next step after y  -> ModelRunnerOutput.spec_token_ids
    scheduler: num_computed += 4 - 1 (d3 rejected: its KV slot is rolled back)

Penalties and min_tokens are applied per verified position with the drafts before
it counted as outputs, so every row sees what plain decoding would have seen.
Requests that ask for logprobs are not speculated (they decode one token a step).
"""

from __future__ import annotations

import time

import torch

from llmserve.layers.sampler import (
    apply_min_tokens,
    apply_penalties,
    build_sampling_metadata,
    compute_logprobs,
    gather_logprobs,
)
from llmserve.scheduler.output import ModelRunnerOutput, SchedulerOutput
from llmserve.spec_decode.config import SpeculativeConfig
from llmserve.spec_decode.policy import DraftLengthPolicy
from llmserve.spec_decode.proposer import Proposer
from llmserve.spec_decode.rejection_sampler import rejection_sample


class SpecDecoder:
    """Verification, proposal and the draft-length policy for one model runner.

    Args:
        config: the speculative config.
        proposer: drafts tokens (n-gram or draft model).
    """

    def __init__(self, config: SpeculativeConfig, proposer: Proposer) -> None:
        self.config = config
        self.proposer = proposer
        self.policy = DraftLengthPolicy(config)
        # seconds of the last proposal (the drafts the next step verifies), None when it
        # caught up on a prompt (goodput.py)
        self._pending_draft_s: float | None = 0.0

    @property
    def num_lookahead_tokens(self) -> int:
        return self.proposer.num_lookahead_tokens

    # ------------------------------------------------------------------ step
    def execute_model(self, runner, sched: SchedulerOutput) -> ModelRunnerOutput:
        """``ModelRunner.execute_model`` with drafts verified and new drafts proposed."""
        t0 = time.perf_counter()
        runner._update_states(sched)
        for req_id in sched.finished_req_ids:
            self.policy.drop(req_id)
        self.proposer.begin_step(runner, sched)
        if sched.kv_cache_ops:
            runner.apply_kv_cache_ops(sched.kv_cache_ops)
            self.proposer.apply_kv_cache_ops(sched.kv_cache_ops)
        out = ModelRunnerOutput()
        if sched.total_num_scheduled_tokens == 0:
            return out
        spec = {r: d for r, d in sched.scheduled_spec_decode_tokens.items() if d}
        for req_id, drafts in spec.items():  # the drafts are this step's last input tokens
            runner.requests[req_id].token_ids.extend(drafts)
        try:
            input_ids, positions, common, logits_idx, states = runner._prepare_inputs(sched)
        finally:
            for req_id, drafts in spec.items():
                del runner.requests[req_id].token_ids[-len(drafts):]
        attn_metadata = runner.model.attn_backend_cls.build_metadata(common)
        hidden = runner.model(input_ids, positions, runner.kv_caches, attn_metadata)
        if not states:
            return out
        ks = [len(spec.get(s.req_id, ())) for s in states]
        rows = [r for last, k in zip(logits_idx.tolist(), ks) for r in range(last - k, last + 1)]
        logits = runner.model.compute_logits(
            hidden[torch.tensor(rows, dtype=torch.long, device=hidden.device)])
        emitted = self._verify(runner, states, ks, spec, logits, out)
        for state, k, tokens in zip(states, ks, emitted):
            state.token_ids.extend(tokens)
            out.sampled_token_ids[state.req_id] = tokens[-1]
            if k:
                out.emitted_token_ids[state.req_id] = tokens
                self.policy.observe(state.req_id, k, len(tokens) - 1)
        if common.num_decodes == sched.total_num_scheduled_tokens:  # decode rows only:
            # the step's time to here (inputs, forward, sampling), by its rows
            seconds, batch_size = time.perf_counter() - t0, len(sched.num_scheduled_tokens)
            self.policy.cost_model.observe_step(len(input_ids), seconds, batch_size)
            # goodput: with the proposal that made this step's drafts (None: a prompt's
            # catch-up, not a cost of drafting; that step is left out)
            drafted = any(ks)
            if not drafted or self._pending_draft_s is not None:
                self.policy.guard.observe(
                    batch_size, seconds + (self._pending_draft_s if drafted else 0.0),
                    sum(len(t) for t in emitted), drafted)
        self._pending_draft_s = 0.0
        self._propose(runner, states, emitted, len(sched.num_scheduled_tokens), out)
        return out

    def _verify(self, runner, states, ks, spec, logits, out) -> list[list[int]]:
        """Rows ``j = 0..k`` of each request: the target after its first ``j`` drafts."""
        params, prompts, outputs, gens = [], [], [], []
        for state, k in zip(states, ks):
            drafts = spec.get(state.req_id, [])
            prompt = state.token_ids[:state.num_prompt_tokens]
            done = state.output_token_ids
            for j in range(k + 1):
                params.append(state.sampling_params)
                prompts.append(prompt)
                outputs.append(done + drafts[:j])
                gens.append(state.generator)
        meta = build_sampling_metadata(params, prompts, outputs, gens, runner.eos_token_ids,
                                       runner.vocab_size, runner.device)
        logits = logits.to(torch.float32)
        raw_logprobs = compute_logprobs(logits) if meta.max_num_logprobs is not None else None
        logits = apply_min_tokens(logits, meta.min_tokens, meta.output_token_ids)
        if not meta.no_penalties:
            logits = apply_penalties(logits, meta.prompt_token_ids, meta.output_token_ids,
                                     meta.presence_penalties, meta.frequency_penalties,
                                     meta.repetition_penalties)
        draft_ids = [t for s in states for t in spec.get(s.req_id, [])]
        draft_probs = None
        if self.proposer.needs_draft_probs and draft_ids:
            draft_probs = torch.cat([self.proposer.draft_probs(s.req_id, k)
                                     for s, k in zip(states, ks) if k])
        emitted = rejection_sample(logits, meta, ks,
                                   torch.tensor(draft_ids, dtype=torch.long), draft_probs)
        if raw_logprobs is not None:  # only requests without drafts ask for logprobs
            starts = [sum(k + 1 for k in ks[:i]) for i in range(len(ks))]
            wanted = [i for i, s in enumerate(states) if s.sampling_params.logprobs is not None]
            ids, lps, ranks = gather_logprobs(
                raw_logprobs[[starts[i] for i in wanted]], meta.max_num_logprobs,
                torch.tensor([emitted[i][-1] for i in wanted], device=raw_logprobs.device))
            ids, lps, ranks = ids.tolist(), lps.tolist(), ranks.tolist()
            for j, i in enumerate(wanted):
                n = states[i].sampling_params.logprobs
                out.logprobs[states[i].req_id] = (ids[j][:n + 1], lps[j][:n + 1], ranks[j])
        return emitted

    def _propose(self, runner, states, emitted, batch_size: int,
                 out: ModelRunnerOutput) -> None:
        max_model_len = runner.config.scheduler_config.max_model_len
        eos = runner.eos_token_ids
        ks = []
        for state, tokens in zip(states, emitted):
            sp = state.sampling_params
            k = self.policy.num_drafts(state.req_id, batch_size)
            stops = set(sp.stop_token_ids or ()) | (set() if sp.ignore_eos else eos)
            if sp.logprobs is not None or any(t in stops for t in tokens):
                k = 0  # logprobs are per step; a stop token ends the request anyway
            # the drafts' positions stay inside max_model_len and max_tokens
            k = min(k, max_model_len - len(state.token_ids))
            if sp.max_tokens is not None:
                k = min(k, sp.max_tokens - len(state.output_token_ids) - 1)
            ks.append(max(k, 0))
        if not any(ks):
            return
        t0 = time.perf_counter()
        drafts = self.proposer.propose(states, ks)
        self._pending_draft_s = None
        if not self.proposer.last_propose_prefilled:  # a prompt's catch-up is no draft cost
            self._pending_draft_s = time.perf_counter() - t0
            self.policy.cost_model.observe_draft(max(ks), self._pending_draft_s, batch_size)
        for state, d in zip(states, drafts):
            if d:
                out.spec_token_ids[state.req_id] = list(d)
