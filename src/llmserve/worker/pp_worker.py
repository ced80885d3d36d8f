"""Pipeline-parallel execution: each rank runs its stage's layers and passes the
hidden states on (vLLM's ``PPMissingLayer`` / ``IntermediateTensors`` scheme).

The driver (world rank 0, stage 0) broadcasts each step to every rank (the world
group, as under tensor parallelism); then the stages run in order. Stage ``s`` receives
``(hidden_states, residual)`` from stage ``s - 1`` over the pp group (torch.distributed
point-to-point send/recv: gloo on CPU), runs its layers and sends the pair to stage
``s + 1``. The last stage applies the final norm and the LM head; its tp rank 0 runs
the sampler and sends the ``ModelRunnerOutput`` back to the driver, which the
scheduler then updates from::

    stage 0 (driver)            stage 1                    ...  last stage (tp rank 0)
    broadcast step  ----------> recv step                       recv step
    embed, layers[0:a]
    send (h, r)     ----------> recv (h, r), layers[a:b]
                                send (h, r) ----------------->  layers[..], norm, logits
                                                                sample
    recv output     <-------------------------------------------send ModelRunnerOutput

With tp > 1 every tp rank of a stage sends its (full, all-reduced) hidden states to
the same tp rank of the next stage. Hidden states cross the pipe in the model dtype.
"""

from __future__ import annotations

import torch

from llmserve.config import EngineConfig
from llmserve.distributed.multiproc import RankFailedError
from llmserve.distributed.parallel_state import ParallelGroups
from llmserve.scheduler.output import ModelRunnerOutput, SchedulerOutput
from llmserve.worker.model_runner import ModelRunner
from llmserve.worker.tp_worker import DriverRunner, FollowerRunner, _strip_for_followers

TAG_STEP, TAG_HIDDEN, TAG_OUTPUT = 1, 2, 3  # point-to-point tags on the pp group


def check_pipeline_config(config: EngineConfig) -> None:
    """Refuse what pipeline stages cannot run yet (before any rank starts).

    Raises:
        ValueError: speculative decoding, LoRA, KV eviction or the shared KV store with
            ``pipeline_parallel_size > 1``; a pp size larger than the model's layers.
    """
    pp = config.parallel_config.pipeline_parallel_size
    if pp == 1:
        return
    from llmserve.models.pipeline_parallel import pp_layer_ranges

    pp_layer_ranges(config.model_config.num_hidden_layers, pp,
                    getattr(config.parallel_config, "pp_layer_partition", None))
    cc = config.cache_config
    refused = [name for name, on in (
        ("speculative decoding", config.speculative_config is not None),
        ("LoRA adapters", config.lora_config is not None),
        ("KV eviction", getattr(cc, "kv_eviction_policy", "none") != "none"),
        ("the shared KV store", getattr(config, "kv_store", None) is not None),
    ) if on]
    if refused:
        raise ValueError(f"pipeline_parallel_size > 1 does not support {', '.join(refused)} "
                         f"yet; use pipeline_parallel_size=1 (tensor parallelism works)")


class PipelineStageMixin:
    """The stage half of a runner (mixed into the driver's and the followers' runners).

    ``is_driver`` (the rank that samples) becomes: last stage and tp rank 0. A stage
    before the last forwards each step's payload, then its hidden states, to the next
    stage *after* computing its part, so stage ``s`` runs micro-batch ``k + 1`` while
    stage ``s + 1`` runs ``k``. The sampler sends outputs with non-blocking sends
    (kept until done), so it never waits on a driver that is busy feeding the pipe.
    """

    groups: ParallelGroups

    def setup_pipeline(self, groups: ParallelGroups) -> None:
        self.groups = groups
        self.is_driver = groups.is_last_stage and groups.tp.is_first_rank
        self.hidden_size = self.config.model_config.hidden_size
        self._payload = None  # the step being run: (SchedulerOutput, sampled, dropped)
        self._pipe_out: torch.Tensor | None = None  # [2, num_tokens, hidden_size]
        self._pending_sends: list = []  # (work, buffer) of the sampler's isends

    def _run_model(self, input_ids: torch.Tensor, positions: torch.Tensor,
                   attn_metadata) -> torch.Tensor | None:
        pp = self.groups.pp
        stage = pp.rank_in_group
        if stage == 0:
            out = self.model(input_ids, positions, self.kv_caches, attn_metadata)
        else:
            # [2, num_tokens, hidden_size]: hidden_states, residual of the previous stage
            pair = pp.recv(torch.empty((2, input_ids.shape[0], self.hidden_size),
                                       dtype=self.dtype, device=self.device),
                           stage - 1, TAG_HIDDEN)
            out = self.model(input_ids, positions, self.kv_caches, attn_metadata,
                             (pair[0], pair[1]))
        if self.groups.is_last_stage:
            return out
        self._pipe_out = torch.stack(out)
        return None

    def _forward_step(self) -> None:
        """A stage before the last: the step's payload, then its hidden states, onward."""
        if self.groups.is_last_stage:
            return
        pp = self.groups.pp
        pp.send_object(self._payload, pp.rank_in_group + 1, TAG_STEP)
        if self._pipe_out is not None:
            pp.send(self._pipe_out, pp.rank_in_group + 1, TAG_HIDDEN)
            self._pipe_out = None

    def _send_output(self, sched: SchedulerOutput, out: ModelRunnerOutput) -> None:
        """The sampler rank: the step's output back to the driver (pp group rank 0)."""
        if not self.is_driver or sched.total_num_scheduled_tokens == 0:
            return
        self._pending_sends = [(w, b) for w, b in self._pending_sends if not w.is_completed()]
        self._pending_sends += self.groups.pp.isend_object(out, 0, TAG_OUTPUT)


class PPDriverRunner(PipelineStageMixin, DriverRunner):
    """World rank 0 under pipeline parallelism: stage 0, and the scheduler's runner.

    :meth:`submit` starts a micro-batch (broadcast to stage 0's tp ranks, stage 0's
    layers, hand-off to stage 1) and returns; :meth:`collect` waits for the oldest
    micro-batch's sampled tokens from the last stage. The engine keeps up to
    ``pipeline_parallel_size`` micro-batches in flight (llm_engine's batch queue).
    """

    def submit(self, sched: SchedulerOutput) -> None:
        def run() -> None:
            self.executor.workers.check()
            self._payload = (_strip_for_followers(sched), self._sampled, self._dropped)
            self.groups.tp.broadcast_object(self._payload)
            self._sampled, self._dropped = {}, []
            ModelRunner.execute_model(self, sched)
            self._forward_step()
        self._guard(run)

    def collect(self) -> ModelRunnerOutput:
        def run() -> ModelRunnerOutput:
            pp = self.groups.pp
            out = pp.recv_object(pp.world_size - 1, TAG_OUTPUT)
            sampled = {r: out.new_token_ids(r) for r in out.sampled_token_ids}
            for req_id, tokens in sampled.items():  # stage 0 builds the next input
                state = self.requests.get(req_id)
                if state is not None:
                    state.token_ids.extend(tokens)
            self._sampled.update(sampled)
            return out
        return self._guard(run)

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """One micro-batch, synchronously (nothing else in flight)."""
        self.submit(sched)
        return self.collect() if sched.total_num_scheduled_tokens else ModelRunnerOutput()

    def _guard(self, fn):
        """Any failure -> :class:`RankFailedError` naming the rank (as DriverRunner)."""
        try:
            return fn()
        except RankFailedError:
            self.executor.workers.shutdown()
            raise
        except Exception as e:
            failure = self.executor.workers.failure(wait_s=2.0)
            self.executor.workers.shutdown()
            if failure is not None:
                raise failure from e
            raise RankFailedError(0, f"failed a step: {type(e).__name__}: {e}") from e


class PPFollowerRunner(PipelineStageMixin, FollowerRunner):
    """Every other rank: its stage's layers; on the last stage's tp rank 0, the sampler."""

    def follow(self, sampled: dict[str, list[int]], dropped: list[str]) -> None:
        super().follow({} if self.is_driver else sampled, dropped)  # the sampler has them

    def next_step(self):
        """The next step's payload: from the driver (stage 0) or the previous stage."""
        if self.groups.pp.rank_in_group == 0:
            self._payload = self.groups.tp.broadcast_object(None)
        else:
            self._payload = self.groups.pp.recv_object(self.groups.pp.rank_in_group - 1,
                                                       TAG_STEP)
        return self._payload

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        out = super().execute_model(sched)
        self._forward_step()
        self._send_output(sched, out)
        return out

    def finish(self) -> None:
        """Shutdown: pass the end on down the pipe; let the last outputs go out."""
        if not self.groups.is_last_stage:
            self._payload = None
            self._forward_step()
        for work, _ in self._pending_sends:
            work.wait()


def make_driver_runner(config: EngineConfig, model, num_blocks: int, num_host_blocks: int,
                       executor) -> DriverRunner:
    """Rank 0's runner: :class:`DriverRunner`, or :class:`PPDriverRunner` when pp > 1."""
    if config.parallel_config.pipeline_parallel_size == 1:
        return DriverRunner(config, model, num_blocks, num_host_blocks, executor)
    runner = PPDriverRunner(config, model, num_blocks, num_host_blocks, executor)
    runner.setup_pipeline(executor.groups)
    return runner
