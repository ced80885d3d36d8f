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
from llmserve.distributed.parallel_state import ParallelGroups
from llmserve.scheduler.output import ModelRunnerOutput, SchedulerOutput
from llmserve.worker.tp_worker import DriverRunner, FollowerRunner


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

    ``is_driver`` (the rank that samples) becomes: last stage and tp rank 0.
    """

    groups: ParallelGroups

    def setup_pipeline(self, groups: ParallelGroups) -> None:
        self.groups = groups
        self.is_driver = groups.is_last_stage and groups.tp.is_first_rank
        self.hidden_size = self.config.model_config.hidden_size

    def _run_model(self, input_ids: torch.Tensor, positions: torch.Tensor,
                   attn_metadata) -> torch.Tensor | None:
        pp = self.groups.pp
        stage = pp.rank_in_group
        if stage == 0:
            out = self.model(input_ids, positions, self.kv_caches, attn_metadata)
        else:
            # [2, num_tokens, hidden_size]: hidden_states, residual of the previous stage
            pair = pp.recv(torch.empty((2, input_ids.shape[0], self.hidden_size),
                                       dtype=self.dtype), stage - 1)
            out = self.model(input_ids, positions, self.kv_caches, attn_metadata,
                             (pair[0], pair[1]))
        if self.groups.is_last_stage:
            return out
        hidden_states, residual = out
        pp.send(torch.stack([hidden_states, residual]), stage + 1)
        return None

    def _send_output(self, sched: SchedulerOutput, out: ModelRunnerOutput) -> None:
        """The sampler rank: the step's output back to the driver (pp group rank 0)."""
        if self.is_driver and sched.total_num_scheduled_tokens > 0 \
                and self.spec_decoder is None:
            self.groups.pp.send_object(out, 0)


class PPDriverRunner(PipelineStageMixin, DriverRunner):
    """World rank 0 under pipeline parallelism: stage 0, and the scheduler's runner; it
    receives each step's sampled tokens from the last stage."""

    def _collect_output(self, sched: SchedulerOutput, out: ModelRunnerOutput
                        ) -> ModelRunnerOutput:
        if sched.total_num_scheduled_tokens == 0:
            return out
        out = self.groups.pp.recv_object(self.groups.pp.world_size - 1)
        for req_id, tok in out.sampled_token_ids.items():  # stage 0 builds the next input
            state = self.requests.get(req_id)
            if state is not None:
                state.token_ids.append(tok)
        return out


class PPFollowerRunner(PipelineStageMixin, FollowerRunner):
    """Every other rank: its stage's layers; on the last stage's tp rank 0, the sampler."""

    def follow(self, sampled: dict[str, int], dropped: list[str]) -> None:
        super().follow({} if self.is_driver else sampled, dropped)  # the sampler has them

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        out = super().execute_model(sched)
        self._send_output(sched, out)
        return out


def make_driver_runner(config: EngineConfig, model, num_blocks: int, num_host_blocks: int,
                       executor) -> DriverRunner:
    """Rank 0's runner: :class:`DriverRunner`, or :class:`PPDriverRunner` when pp > 1."""
    if config.parallel_config.pipeline_parallel_size == 1:
        return DriverRunner(config, model, num_blocks, num_host_blocks, executor)
    runner = PPDriverRunner(config, model, num_blocks, num_host_blocks, executor)
    runner.setup_pipeline(executor.groups)
    return runner
