"""Packaging, in this process: the client's keyword options are its ChannelConfig. That the
client stays light, the CLI works and unsafe binds are refused is checked with real processes
in tests/e2e/test_packaging_and_cli.py.
"""

from __future__ import annotations

import dataclasses

from enginectl.client import ChannelConfig
from enginectl.client.client import ChannelOptions


def test_client_keyword_options_are_the_channel_config() -> None:
    """Client(target, **options) is typed by ChannelOptions: it must name ChannelConfig's fields."""
    fields = {f.name for f in dataclasses.fields(ChannelConfig)}
    assert set(ChannelOptions.__annotations__) == fields - {"target"}
