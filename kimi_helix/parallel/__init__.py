"""Tensor and Helix context parallelism: an explicit `Mapping`, the page-ownership rule, weight sharding and the
Helix MLA exchange. Nothing here is global: every function takes the mapping (and a communicator) it needs."""

from .mapping import Mapping, ParallelConfigError
from .ownership import Ownership

__all__ = ["Mapping", "Ownership", "ParallelConfigError"]
