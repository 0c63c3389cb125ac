"""Numeric addresses, told apart without the resolver (``_core.net``)."""

from __future__ import annotations

import socket

import pytest

from tdist._core.net import literal_family, literal_loopback

pytestmark = pytest.mark.timeout(10)


@pytest.mark.parametrize(
    ("host", "family", "loopback"),
    [
        ("127.0.0.1", socket.AF_INET, True),
        ("127.1.2.3", socket.AF_INET, True),
        ("10.0.0.1", socket.AF_INET, False),
        ("::1", socket.AF_INET6, True),
        ("0:0:0:0:0:0:0:1", socket.AF_INET6, True),
        ("::", socket.AF_INET6, False),
        ("fe80::1%lo", socket.AF_INET6, False),
        ("localhost", None, False),  # (a name: the resolver's)
        ("", None, False),
        ("1.2.3", None, False),  # (inet_aton's short form: left to the resolver, which takes it)
        ("256.0.0.1", None, False),
    ],
)
def test_literal_addresses(host: str, family: int | None, loopback: bool) -> None:
    assert literal_family(host) == family
    assert literal_loopback(host) is loopback


def test_the_interface_gloo_socket_ifname_names_gives_the_advertised_address(monkeypatch: pytest.MonkeyPatch) -> None:
    from tdist._core.errors import DistNetworkError
    from tdist.transport._link import advertised_address

    monkeypatch.delenv("TDIST_ADDR", raising=False)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    assert advertised_address(None) == "127.0.0.1"
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "nonexistent0,lo")  # (the first one is used, as gloo's device)
    with pytest.raises(DistNetworkError, match="Unable to find address for: nonexistent0"):
        advertised_address(None)
    # RPC reads TensorPipe's variable instead
    monkeypatch.setenv("TP_SOCKET_IFNAME", "lo")
    assert advertised_address(None, "TP_SOCKET_IFNAME") == "127.0.0.1"
    monkeypatch.setenv("TDIST_ADDR", "127.0.0.5")  # (tdist's own variable wins)
    assert advertised_address(None) == "127.0.0.5"
