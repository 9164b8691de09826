"""Rank discovery from the environment (the distributed part of the run configuration), pure logic."""

from __future__ import annotations

import pytest

from comera_dist.engine.distributed import LOOPBACK, discover_ranks


def test_launcher_env_is_kept():
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "1234"}
    assert discover_ranks(env) == "env"
    assert env["LOCAL_RANK"] == "0" and env["MASTER_ADDR"] == "10.0.0.5"


def test_openmpi_on_one_host_is_forced_to_loopback():
    env = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_ADDR": "192.168.1.7"}
    assert discover_ranks(env) == "openmpi"
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == ("1", "2", "1")
    assert env["MASTER_ADDR"] == LOOPBACK and env["MASTER_PORT"] == "29500"


def test_openmpi_across_hosts_needs_master_addr():
    env = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    with pytest.raises(RuntimeError, match="MASTER_ADDR is not set"):
        discover_ranks(env)
    env["MASTER_ADDR"] = "10.0.0.1"
    assert discover_ranks(env) == "openmpi" and env["MASTER_ADDR"] == "10.0.0.1"


def test_single_process_gets_a_free_loopback_port():
    env: dict[str, str] = {}
    assert discover_ranks(env) == "single"
    assert (env["RANK"], env["WORLD_SIZE"], env["MASTER_ADDR"]) == ("0", "1", LOOPBACK)
    assert 0 < int(env["MASTER_PORT"]) < 65536
