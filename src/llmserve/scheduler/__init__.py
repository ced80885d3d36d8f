"""Continuous-batching scheduler (pure Python)."""

from llmserve.scheduler.output import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from llmserve.scheduler.request import Request, RequestStatus
from llmserve.scheduler.scheduler import Scheduler, SchedulerStats

__all__ = [
    "CachedRequestData", "EngineCoreOutput", "ModelRunnerOutput", "NewRequestData", "Request",
    "RequestStatus", "Scheduler", "SchedulerOutput", "SchedulerStats",
]
