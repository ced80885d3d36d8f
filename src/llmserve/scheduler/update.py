"""The scheduler's half after a step: :meth:`SchedulerUpdateMixin.update_from_output`
turns the model runner's sampled tokens into request progress (computed tokens,
cached blocks, stop conditions, forks of ``n > 1`` siblings, draft caps).

A mixin of :class:`~llmserve.scheduler.scheduler.Scheduler` (its state: ``requests``,
``running``, ``waiting``, ``kv_cache_manager``, ``pending_forks``, ``stats``), kept in
its own file so each half stays readable.
"""

from __future__ import annotations

from llmserve.scheduler.output import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from llmserve.scheduler.request import Request, RequestStatus


class SchedulerUpdateMixin:
    # ------------------------------------------------------------------ update
    def update_from_output(self, sched_out: SchedulerOutput,
                           runner_out: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Advance ``num_computed_tokens``, cache full blocks, append sampled tokens,
        fork waiting ``n > 1`` siblings, finish requests that hit a token-level stop
        condition and free their blocks."""
        outputs: list[EngineCoreOutput] = []
        kv = self.kv_cache_manager
        for req_id, num_new in sched_out.num_scheduled_tokens.items():
            req = self.requests.get(req_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # aborted or preempted meanwhile
            tokens = runner_out.new_token_ids(req_id)
            drafts = sched_out.scheduled_spec_decode_tokens.get(req_id, ())
            # rejected drafts: their KV slots are rolled back (recomputed if ever needed)
            req.num_computed_tokens += num_new - (len(drafts) - len(tokens) + 1 if drafts and tokens else 0)
            scores = runner_out.kv_block_scores.get(req_id)
            if scores is not None and req.eviction is not None:  # H2O / SnapKV votes
                req.eviction.add_scores(scores)
            finished = False
            new_tokens: list[int] = []
            for t in tokens:  # EOS, a stop id or max_tokens may fall inside a drafted or
                # forced run
                req.append_output_token_ids([t])
                new_tokens.append(t)
                finished = req.check_stop(self.max_model_len)
                if finished:
                    break
            req.spec_token_ids = self._cap_drafts(req, runner_out.spec_token_ids.get(req_id))
            kv.cache_blocks(req_id, req.all_token_ids, req.num_computed_tokens, req.extra_keys)
            if drafts and not finished:
                kv.trim(req_id, req.num_tokens + len(req.spec_token_ids))
            if req_id in self.pending_forks and req.num_computed_tokens >= req.num_prompt_tokens:
                self._fork_children(req)
            if not tokens:
                continue  # a partial prefill chunk: nothing sampled
            outputs.append(EngineCoreOutput(
                req_id, new_tokens, finish_reason=req.get_finished_reason() if finished else None,
                stop_reason=req.stop_reason, new_logprobs=runner_out.logprobs.get(req_id),
                num_cached_tokens=max(req.num_cached_tokens, 0)))
            if req_id in runner_out.prompt_logprobs:
                outputs[-1].extra["prompt_logprobs"] = runner_out.prompt_logprobs[req_id]
            if finished:
                self.running.remove(req)
                self._free_request(req)
        self.stats.num_running_reqs = len(self.running)
        self.stats.num_waiting_reqs = len(self.waiting)
        self.stats.kv_cache_usage = kv.usage
        return outputs

    def _cap_drafts(self, req: Request, drafts: list[int] | None) -> list[int]:
        """Drafts for the next step, capped so every verified position stays inside
        ``max_model_len`` and no draft lies past ``max_tokens``."""
        if not drafts:
            return []
        room = min(self.max_model_len - req.num_tokens,
                   req.max_tokens - req.num_output_tokens - 1)
        return list(drafts[:max(room, 0)])

    def _fork_children(self, leader: Request) -> None:
        """Share the leader's prompt blocks with its waiting siblings; each recomputes
        only the last prompt token (for its own logits), copy-on-write."""
        children = self.pending_forks.pop(leader.request_id)
        for child in reversed(children):
            self.kv_cache_manager.fork(leader.request_id, child.request_id,
                                       child.num_prompt_tokens)
            child.num_computed_tokens = child.num_prompt_tokens - 1
            if child.eviction is not None and leader.eviction is not None:
                n = len(self.kv_cache_manager.req_to_blocks.get(child.request_id, ()))
                child.eviction.logical = list(leader.eviction.logical[:n])
                child.eviction.scores = list(leader.eviction.scores[:n])
            child.num_cached_tokens = max(leader.num_cached_tokens, 0)
            child.fork_from = None
            child.status = RequestStatus.WAITING
            self.waiting.prepend(child)
