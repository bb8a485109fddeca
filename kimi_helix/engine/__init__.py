"""Inference engine: paged hybrid cache, continuous-batching scheduler, sampling and the `LLM` API."""

from .cache import PagedCache, PageLedger
from .llm import LLM, RequestOutput, StepMetrics
from .planner import MemoryPlan, plan_memory
from .sampling import SamplingParams
from .scheduler import RequestMetrics

__all__ = [
    "LLM",
    "MemoryPlan",
    "PageLedger",
    "PagedCache",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "StepMetrics",
    "plan_memory",
]
