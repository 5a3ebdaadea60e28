"""--ucx-host/--ucx-port become the UCX variables that keep its TCP sockets on one interface."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.shared.kv import ucx_config
from pdserve.shared.kv.ucx_config import (
    UCXConfigError,
    interface_addresses,
    interface_for,
    ucx_environment,
)


def test_loopback_addresses_map_to_the_loopback_device() -> None:
    lo = interface_for("127.0.0.1")
    assert lo is not None and interface_addresses()[lo].startswith("127.")
    assert interface_for("localhost") == lo
    assert interface_for("127.0.0.2") == lo  # all of 127/8 lives on it


def test_every_interface_address_maps_to_its_own_device() -> None:
    for name, address in interface_addresses().items():
        if not address.startswith("127."):
            assert interface_for(address) == name


def test_wildcard_means_no_restriction() -> None:
    for host in ("0.0.0.0", "", "*"):
        assert interface_for(host) is None
        assert ucx_environment(host) == {}


def test_addresses_of_other_machines_and_bad_names_are_refused() -> None:
    with pytest.raises(UCXConfigError, match="not an address of this machine"):
        interface_for("203.0.113.7")  # TEST-NET-3: nobody's
    with pytest.raises(UCXConfigError, match="does not resolve"):
        interface_for("no-such-host.invalid")


def test_environment_pins_device_and_port(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    lo = interface_for("127.0.0.1")
    monkeypatch.setattr(ucx_config, "rdma_devices", lambda: [])
    assert ucx_environment("127.0.0.1") == {"UCX_NET_DEVICES": lo}
    assert ucx_environment("127.0.0.1", 47000) == {
        "UCX_NET_DEVICES": lo,
        "UCX_TCP_PORT_RANGE": "47000-47000",
    }


def test_rdma_ports_stay_enabled(tmp_path: Path) -> None:
    for dev, ports in {"mlx5_0": ["1"], "mlx5_1": ["1", "2"]}.items():
        for port in ports:
            (tmp_path / dev / "ports" / port).mkdir(parents=True)
    assert ucx_config.rdma_devices(tmp_path) == ["mlx5_0:1", "mlx5_1:1", "mlx5_1:2"]
    assert ucx_config.rdma_devices(tmp_path / "absent") == []


def test_configure_sets_the_process_environment_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ucx_config, "_applied", None)
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    monkeypatch.delenv("UCXPY_PROGRESS_MODE", raising=False)
    monkeypatch.setenv("UCX_TCP_PORT_RANGE", "5000-5010")  # the user's own setting wins
    monkeypatch.setattr(ucx_config, "rdma_devices", lambda: [])
    applied = ucx_config.configure("127.0.0.1", 47000)
    lo = interface_for("127.0.0.1")
    assert applied == {
        "UCX_NET_DEVICES": lo,
        "UCX_TCP_PORT_RANGE": "5000-5010",
        "UCXPY_PROGRESS_MODE": "blocking",
    }
    # UCX has read its variables by now: a second, different call changes nothing
    assert ucx_config.configure("0.0.0.0") == applied


def test_a_link_local_ucx_host_is_warned_about(caplog):
    from pdserve.shared.kv.ucx_config import warn_if_link_local

    assert warn_if_link_local("169.254.7.2")
    assert "link-local" in caplog.text
    assert not warn_if_link_local("127.0.0.1")
    assert not warn_if_link_local("::1")
    assert not warn_if_link_local("eth0")
