"""Reading a request's kv_transfer_params["draft_offload"] (request_options.py)."""

from __future__ import annotations

from typing import Any

import pytest

from vllm_draft_offload.request_options import DEFAULT, UNREADABLE, RequestOptions, request_options


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (None, DEFAULT),
        ({}, DEFAULT),
        ({"other_connector": {"store": False}}, DEFAULT),
        ({"draft_offload": {}}, DEFAULT),
        ({"draft_offload": {"store": False}}, RequestOptions(store=False)),
        ({"draft_offload": {"load": False}}, RequestOptions(load=False)),
        ({"draft_offload": {"store": False, "load": False}}, UNREADABLE),
        ({"draft_offload": {"store": "false"}}, UNREADABLE),
        ({"draft_offload": {"store": 0}}, UNREADABLE),
        ({"draft_offload": {"stor": False}}, UNREADABLE),
        ({"draft_offload": True}, UNREADABLE),
    ],
)
def test_options(params: dict[str, Any] | None, expected: RequestOptions) -> None:
    assert request_options(params) == expected


def test_unreadable_options_name_the_field(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="vllm_draft_offload.request_options"):
        request_options({"draft_offload": {"load": "yes", "x": 1}}, "req-7")
    assert "req-7" in caplog.text
    assert "kv_transfer_params.draft_offload.load" in caplog.text
    assert "kv_transfer_params.draft_offload.x" in caplog.text
