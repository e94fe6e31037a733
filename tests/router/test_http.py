"""The HTTP door's own answers, over a scripted cluster (no Ray)."""

from __future__ import annotations

from fastapi.testclient import TestClient

from router.http import create_app
from router.tokenizer import TextCodec
from tests.router.test_frontdoor import ScriptedCluster, door_over


def test_unknown_routes_and_methods_answer_in_the_openai_error_shape(codec: TextCodec) -> None:
    client = TestClient(create_app(door_over(ScriptedCluster(), codec)))
    missing = client.post("/v1/embeddings", json={"input": "hi"})
    assert missing.status_code == 404
    assert missing.json() == {
        "error": {
            "message": "Not Found: POST /v1/embeddings",
            "type": "invalid_request_error",
            "param": None,
            "code": 404,
        }
    }
    wrong = client.get("/v1/completions")
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
    assert wrong.json()["error"]["message"] == "Method Not Allowed: GET /v1/completions"
    assert wrong.json()["error"]["code"] == 405
    named = client.get("/v1/models/other")  # an ApiError, as before
    assert named.status_code == 404 and named.json()["error"]["param"] == "model"
