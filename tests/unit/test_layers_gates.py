"""The gate rule shared by the layers and the penalty: ``layers.base.gate_alive`` / ``gate_sums``."""

import torch

from comera_dist.compression.penalty import penalty_from_gates
from comera_dist.layers.base import gate_sums


def test_gate_sums_use_each_gate_tensors_own_python_threshold():
    """Different Python-number thresholds per gate tensor: each tensor is compared with its own."""
    gates = [torch.tensor([0.2, 0.05]), torch.tensor([0.3, 0.6])]
    (total, count), = gate_sums(gates, [0.1, 0.5])  # alive: [0.2] and [0.6]
    torch.testing.assert_close(total, torch.tensor(0.8))
    assert count.item() == 2
    torch.testing.assert_close(penalty_from_gates(gates, [0.1, 0.5]), torch.tensor(0.4))
    (total, count), = gate_sums(gates, [0.1, 0.1])  # one shared number: 0.2, 0.3 and 0.6 survive
    torch.testing.assert_close(total, torch.tensor(1.1))
    assert count.item() == 3
