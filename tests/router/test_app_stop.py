"""Why `router.app`'s door stops, from Serve's status (no Ray): an update or a health-check
restart hands the cluster over, a delete stops it."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from router.app import app_staying


@pytest.mark.parametrize(
    ("applications", "stays"),
    [
        ({"slos-serve": "DEPLOYING"}, True),  # an update
        ({"slos-serve": "UNHEALTHY"}, True),  # a health-check restart
        ({"slos-serve": "RUNNING"}, True),
        ({"slos-serve": "DELETING"}, False),  # a delete, or Serve shutting down
        ({"other": "RUNNING"}, False),  # gone
        (RuntimeError("no Serve controller"), False),
    ],
)
def test_a_stopped_door_hands_its_cluster_over_unless_its_app_goes(
    monkeypatch: pytest.MonkeyPatch, applications: dict[str, str] | Exception, stays: bool
) -> None:
    """What `__del__` decides from Serve's status: the cluster outlives the door (the next
    one attaches, models loaded) unless the app is deleted or Serve cannot say."""
    from ray import serve
    from ray.serve.schema import ApplicationStatus

    def status() -> SimpleNamespace:
        if isinstance(applications, Exception):
            raise applications
        return SimpleNamespace(
            applications={
                name: SimpleNamespace(status=ApplicationStatus(state))
                for name, state in applications.items()
            }
        )

    monkeypatch.setattr(
        serve, "get_replica_context", lambda: SimpleNamespace(app_name="slos-serve")
    )
    monkeypatch.setattr(serve, "status", status)
    assert asyncio.run(app_staying()) is stays
