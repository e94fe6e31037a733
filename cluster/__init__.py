"""The control plane across replicas: controller, virtual replicas, routing, simulator.

`launch` and `ClusterHandle` import Ray; they load on first use so the pure modules
(routing, control, virtual replicas) stay importable without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cluster.handle import ClusterHandle, launch

__all__ = ["ClusterHandle", "launch"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from cluster import handle

        return getattr(handle, name)
    raise AttributeError(f"module 'cluster' has no attribute {name!r}")
