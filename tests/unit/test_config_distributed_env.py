"""Rank discovery from the environment (the distributed part of the run configuration), pure logic."""

from __future__ import annotations

import contextlib
import socket

import pytest

from comera_dist.engine.distributed import DEFAULT_PORT, LOOPBACK, discover_ranks, init_distributed
from comera_dist.engine.errors import InputError
from comera_dist.engine.ports import ephemeral_low


def test_launcher_env_is_kept():
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "1234"}
    assert discover_ranks(env) == "env"
    assert env["LOCAL_RANK"] == "0" and env["MASTER_ADDR"] == "10.0.0.5"


@pytest.mark.parametrize(("rank", "world"), [("0", "abc"), ("x", "2"), ("2", "2"), ("-1", "2")])
def test_a_bad_launcher_rank_or_world_size_names_both(rank, world):
    with pytest.raises(InputError, match=f"the launcher's RANK={rank!r} and WORLD_SIZE={world!r} \\(environment\\) "
                                         "must be integers with 0 <= RANK < WORLD_SIZE"):
        discover_ranks({"RANK": rank, "WORLD_SIZE": world})


def test_openmpi_on_one_host_is_forced_to_loopback():
    env = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_ADDR": "192.168.1.7"}
    assert discover_ranks(env) == "openmpi"
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == ("1", "2", "1")
    assert env["MASTER_ADDR"] == LOOPBACK and env["MASTER_PORT"] == "29500"


def test_openmpi_across_hosts_needs_master_addr():
    env = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    with pytest.raises(InputError, match="MASTER_ADDR is not set"):  # comera pretrain: one line, exit 2
        discover_ranks(env)
    env["MASTER_ADDR"] = "10.0.0.1"
    assert discover_ranks(env) == "openmpi" and env["MASTER_ADDR"] == "10.0.0.1"
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == ("3", "4", "0")  # the world's rank, not the host's


def test_single_process_gets_a_free_loopback_port():
    """Not the default port: a second single-process run on the host (an evaluation beside a debug run) would
    fail to bind it."""
    with socket.socket() as held:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        with contextlib.suppress(OSError):  # already taken by someone else: it stays taken either way
            held.bind((LOOPBACK, DEFAULT_PORT))
            held.listen()
        env: dict[str, str] = {}
        assert discover_ranks(env) == "single"
        assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["MASTER_ADDR"]) == ("0", "1", "0", LOOPBACK)
        with socket.socket() as probe:
            probe.bind((LOOPBACK, int(env["MASTER_PORT"])))  # free while the default one is held
        assert int(env["MASTER_PORT"]) < ephemeral_low()  # not a port the kernel hands to outgoing connections


def test_single_process_keeps_a_given_master_addr_and_port():
    env = {"MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "1234"}
    assert discover_ranks(env) == "single"
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("10.0.0.5", "1234")


def test_a_collective_timeout_must_be_positive():
    with pytest.raises(ValueError, match="timeout_s must be > 0, got 0"):
        init_distributed(0)
