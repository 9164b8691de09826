"""``engine.ports.free_port``: rendezvous ports (the product's single-process runs, ``bench comm``'s spawned
ranks, ``launch/gpu_check.sh``'s side-by-side runs, the tests') come from below the kernel's ephemeral range,
where no outgoing connection can take one between the probe and the job's bind."""

import socket
import subprocess
import sys

from comera_dist.engine.ports import LOWEST, ephemeral_low, free_port


def test_free_ports_are_bindable_and_below_the_ephemeral_range():
    low = ephemeral_low()
    ports = {free_port() for _ in range(20)}
    assert all(LOWEST <= p < low for p in ports), (sorted(ports), low)
    assert len(ports) > 1  # drawn at random, not one fixed port every caller would share
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_the_module_prints_one_port_for_shell_scripts():
    """``launch/gpu_check.sh`` reads its runs' ``MASTER_PORT`` from ``python -m comera_dist.engine.ports``."""
    r = subprocess.run([sys.executable, "-m", "comera_dist.engine.ports"], capture_output=True, text=True,
                       timeout=60, check=True)
    assert LOWEST <= int(r.stdout) < ephemeral_low(), r.stdout
    bad = subprocess.run([sys.executable, "-m", "comera_dist.engine.ports", "7"], capture_output=True, text=True,
                         timeout=60, check=False)
    assert bad.returncode != 0 and "takes no arguments, got ['7']" in bad.stderr, bad.stderr
