"""--ucx-host/--ucx-port become the UCX variables that keep its TCP sockets on one interface."""

from __future__ import annotations

import os
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
    for key in ("UCX_NET_DEVICES", "UCXPY_PROGRESS_MODE", *ucx_config.SHM_ERROR_HANDLING):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("UCX_TCP_PORT_RANGE", "5000-5010")  # the user's own setting wins
    monkeypatch.setenv("UCX_KEEPALIVE_INTERVAL", "5s")  # so does this one
    monkeypatch.setattr(ucx_config, "rdma_devices", lambda: [])
    applied = ucx_config.configure("127.0.0.1", 47000)
    lo = interface_for("127.0.0.1")
    assert applied == {
        "UCX_NET_DEVICES": lo,
        "UCX_TCP_PORT_RANGE": "5000-5010",
        "UCXPY_PROGRESS_MODE": "blocking",
        "UCX_MM_ERROR_HANDLING": "y",  # shared memory between two workers of one host
        "UCX_KEEPALIVE_INTERVAL": "5s",
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


def test_shared_memory_is_let_in_unless_the_user_decided() -> None:
    """ucxx's endpoints handle peer failure, which UCX's posix/sysv offer only with
    UCX_MM_ERROR_HANDLING=y: without it two workers of one host talk over tcp/lo."""
    assert ucx_config.shm_environment({}) == {
        "UCX_MM_ERROR_HANDLING": "y",
        "UCX_KEEPALIVE_INTERVAL": ucx_config.KEEPALIVE_INTERVAL,
    }
    for key in ucx_config.SHM_ERROR_HANDLING:  # UCX_POSIX_/SYSV_ win over UCX_MM_: all count
        assert "UCX_MM_ERROR_HANDLING" not in ucx_config.shm_environment({key: "n"})
    assert (
        ucx_config.shm_environment({"UCX_MM_ERROR_HANDLING": "n", "UCX_KEEPALIVE_INTERVAL": "20s"})
        == {}
    )
    # hosts that are network namespaces of one machine turn shared memory off with UCX_TLS,
    # which nothing here touches
    assert "UCX_TLS" not in ucx_config.shm_environment({"UCX_TLS": "^sm"})


def test_configure_keeps_the_users_shared_memory_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ucx_config, "_applied", None)
    monkeypatch.delenv("UCX_MM_ERROR_HANDLING", raising=False)
    monkeypatch.delenv("UCX_KEEPALIVE_INTERVAL", raising=False)
    monkeypatch.setenv("UCX_POSIX_ERROR_HANDLING", "n")
    monkeypatch.setenv("UCX_TLS", "^sm")
    monkeypatch.setattr(ucx_config, "rdma_devices", lambda: [])
    applied = ucx_config.configure("127.0.0.1")
    assert "UCX_MM_ERROR_HANDLING" not in applied
    assert applied["UCX_KEEPALIVE_INTERVAL"] == ucx_config.KEEPALIVE_INTERVAL
    assert os.environ["UCX_TLS"] == "^sm" and os.environ["UCX_POSIX_ERROR_HANDLING"] == "n"
